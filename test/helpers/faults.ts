/**
 * Fault injection against `treepack pack --out`: kill -9 a run at random points, pause one writer while another
 * runs, and judge what a reader finds in --out afterwards. The judge knows nothing of the layout behind the
 * manifest: it follows manifest.json to the files it names and compares bytes with reference runs, so the same
 * harness measures any implementation (TREEPACK_FAULT_BIN points it at another build).
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync, lstatSync, mkdirSync, readdirSync, readFileSync, rmSync, watch, writeFileSync, type FSWatcher } from 'node:fs';
import { dirname, join } from 'node:path';
import { BIN } from './cli.js';

export const FAULT_BIN = process.env.TREEPACK_FAULT_BIN ?? BIN;

/** Every file under `dir` (hidden ones included), by path relative to `dir`. */
export type Snapshot = Map<string, Buffer>;

export function snapshot(dir: string): Snapshot {
  const snap: Snapshot = new Map();
  const walk = (rel: string) => {
    for (const name of readdirSync(join(dir, rel))) {
      const r = rel ? `${rel}/${name}` : name;
      if (lstatSync(join(dir, r)).isDirectory()) walk(r);
      else snap.set(r, readFileSync(join(dir, r)));
    }
  };
  if (existsSync(dir)) walk('');
  return snap;
}

/** Paths that differ between two snapshots (Buffer.equals: a deep equality on megabytes of data takes minutes). */
export function differences(a: Snapshot, b: Snapshot): string[] {
  const keys = new Set([...a.keys(), ...b.keys()]);
  return [...keys].filter((k) => !a.get(k) || !b.get(k) || !a.get(k)!.equals(b.get(k)!)).sort();
}

/** Makes `dir` hold exactly `snap` (or not exist, for null). */
export function restore(dir: string, snap: Snapshot | null): void {
  rmSync(dir, { recursive: true, force: true });
  if (snap === null) return;
  mkdirSync(dir, { recursive: true });
  for (const [rel, bytes] of snap) {
    mkdirSync(dirname(join(dir, rel)), { recursive: true });
    writeFileSync(join(dir, rel), bytes);
  }
}

const hidden = (rel: string) => rel.split('/').some((c) => c.startsWith('.'));

/** A complete run: the whole directory it left, and the files its manifest names, in manifest order. */
export interface Reference {
  name: string;
  manifest: Buffer;
  files: string[];
  snap: Snapshot;
}

export function reference(name: string, out: string): Reference {
  const snap = snapshot(out);
  const manifest = snap.get('manifest.json');
  if (!manifest) throw new Error(`reference ${name}: no manifest.json in ${out}`);
  const files = (JSON.parse(manifest.toString('utf8')).micro_batches as { file: string }[]).map((e) => e.file);
  return { name, manifest, files, snap };
}

/**
 * Optional normalisation of manifest bytes and file names before comparing (e.g. a generation number that depends
 * on how many runs came before); identity by default, so comparisons are byte for byte.
 */
export type Normalize = (s: string) => string;
const identity: Normalize = (s) => s;

export interface Verdict {
  /** 'none': --out does not exist; otherwise the reference whose committed view --out holds, or 'broken'. */
  outcome: string;
  problems: string[];
  /** Hidden leftovers (staging, temp files, locks): paths relative to --out. */
  hidden: string[];
  hiddenBytes: number;
}

/**
 * What a reader of `out` gets: manifest.json must equal one reference's, byte for byte (after `norm`), every file
 * it names must equal that reference's file, and no visible file may be one no reference names (a reader globbing
 * the directory would mix runs). Files another reference names are allowed if byte-identical to it (a retained
 * earlier generation).
 */
export function judge(out: string, refs: Reference[], norm: Normalize = identity): Verdict {
  if (!existsSync(out)) return { outcome: 'none', problems: [], hidden: [], hiddenBytes: 0 };
  const snap = snapshot(out);
  const hiddenPaths = [...snap.keys()].filter(hidden);
  const hiddenBytes = hiddenPaths.reduce((n, p) => n + snap.get(p)!.length, 0);
  const problems: string[] = [];
  const manifest = snap.get('manifest.json');
  let outcome = 'broken';
  if (!manifest) problems.push('no manifest.json');
  else {
    const m = norm(manifest.toString('utf8'));
    const ref = refs.find((r) => norm(r.manifest.toString('utf8')) === m);
    if (!ref) problems.push('manifest.json equals no complete run');
    else {
      const got = (JSON.parse(manifest.toString('utf8')).micro_batches as { file: string }[]).map((e) => e.file);
      got.forEach((file, i) => {
        const bytes = snap.get(file);
        const want = ref.snap.get(ref.files[i])!;
        if (!bytes) problems.push(`${file} (named by the manifest) is missing`);
        else if (!bytes.equals(want)) problems.push(`${file} differs from run ${ref.name}'s`);
      });
      if (problems.length === 0) outcome = ref.name;
    }
  }
  const named = new Set(manifest ? (JSON.parse(manifest.toString('utf8')).micro_batches as { file: string }[]).map((e) => e.file) : []);
  named.add('manifest.json');
  for (const [rel, bytes] of snap) {
    if (hidden(rel) || named.has(rel)) continue;
    const other = refs.find((r) => r.files.includes(rel) && r.snap.get(rel)!.equals(bytes));
    if (!other) problems.push(`stray visible file ${rel}`);
  }
  if (problems.length) outcome = 'broken';
  return { outcome, problems, hidden: hiddenPaths, hiddenBytes };
}

export interface RunResult {
  code: number | null;
  signal: NodeJS.Signals | null;
  stderr: string;
  ms: number;
}

export interface Pack {
  child: ChildProcess;
  done: Promise<RunResult>;
}

/** Starts `treepack pack input --out out ...extra`. */
export function startPack(input: string, out: string, extra: string[] = []): Pack {
  const t0 = performance.now();
  const child = spawn(process.execPath, [FAULT_BIN, 'pack', input, '--out', out, '--quiet', ...extra], {
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  let stderr = '';
  child.stderr.setEncoding('utf8').on('data', (s: string) => (stderr += s));
  const done = new Promise<RunResult>((resolve, reject) => {
    child.on('error', reject);
    // 'close' (not 'exit'): the child is reaped and its stderr drained, so a dead writer is really gone.
    child.on('close', (code, signal) => resolve({ code, signal, stderr, ms: performance.now() - t0 }));
  });
  return { child, done };
}

/**
 * Calls `onEvent(n)` for the n-th file-system event (1-based) in the directory `out` lives in or, once it exists,
 * in `out` itself: the places a publish creates, renames and removes entries.
 */
export function watchOut(out: string, onEvent: (n: number) => void): () => void {
  let n = 0;
  const watchers: FSWatcher[] = [];
  const fire = () => onEvent(++n);
  const add = (dir: string) => {
    try {
      watchers.push(watch(dir, { persistent: false }, fire));
    } catch {
      // not there (yet): the parent's watcher sees it appear
    }
  };
  add(out);
  if (!existsSync(out)) {
    // A run may create --out: watch the parent and start watching --out when it appears.
    watchers.push(
      watch(dirname(out), { persistent: false }, () => {
        fire();
        if (watchers.length === 1 && existsSync(out)) add(out);
      }),
    );
  }
  return () => watchers.forEach((w) => w.close());
}

/** A failed run must say what went wrong in one `treepack pack: ...` line, never a JavaScript stack trace. */
export function stackTrace(stderr: string): boolean {
  return /^\s+at \S/m.test(stderr) || stderr.includes('node:internal');
}
