/**
 * Publishing a run's files into an output directory as one atomic step, the way storage engines commit a new
 * version: files go to a private staging directory, then become `gen-NNNNNN/` (a name no reader follows yet), and
 * renaming the new `manifest.json` over the old one is the single commit point. A reader that starts from
 * manifest.json and opens only the files it names sees the old run or the new one, whole, whatever moment a writer
 * dies at. Layout and guarantees: docs/operations/output-directory.md.
 *
 *   out/manifest.json                       the commit point; names gen-NNNNNN/<file> for every file
 *   out/gen-NNNNNN/                         the committed generation, and the one before it (kept for readers
 *                                           that read the previous manifest just before the swap)
 *   out/.treepack-staging-gen-NNNNNN/       a run in progress: owner.json (pid, host, boot, start), files/
 *   <nearest existing ancestor>/.treepack-new-<pid>-<hex>/
 *                                           a run into a --out that does not exist yet: out/ is renamed to --out
 *
 * Claiming generation N is the lock: the staging directory is built under a temporary name and renamed to
 * `.treepack-staging-gen-N`, which fails if another writer claimed N first. A run refuses to start while any
 * staging directory belongs to a live process, and commits only if the manifest is still the one it started from
 * (compare-and-swap), so two writers never both publish over the same base. Staging left by a dead process
 * (kill -9, power loss) is removed by the next run, which claims the number above it. A run that fails or is
 * aborted removes everything it made: a --out it would have created does not exist afterwards.
 */
import { randomBytes } from 'node:crypto';
import { existsSync, mkdirSync, readdirSync, readFileSync, renameSync, rmSync, statSync } from 'node:fs';
import { hostname } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { argError, TreepackError } from '../errors.js';
import { ioError, syncDirectory, writeFileAtomic } from './atomic.js';
import { MANIFEST_FILE } from './sink.js';

const GEN = /^gen-(\d{6,})$/;
const STAGING = /^\.treepack-staging-gen-(\d{6,})$/;
/** Leftovers that name their owner's pid: a claim being built, a run into a new --out, temp files of atomic writes. */
const PID_NAMED = /^(?:\.treepack-tmp-|\.treepack-new-|manifest\.json\.tmp-)(\d+)-/;
/** Older treepack versions staged into `.treepack-staging-<pid>` and wrote micro-batches at the top level. */
const LEGACY_STAGING = /^\.treepack-staging-(\d+)$/;
const LEGACY_FILE = /^microbatch-\d+\.safetensors$/;

const genName = (n: number) => `gen-${String(n).padStart(6, '0')}`;
const stagingName = (n: number) => `.treepack-staging-${genName(n)}`;

interface Owner {
  pid: number;
  host: string;
  /** Linux: /proc/sys/kernel/random/boot_id, so a pid from before a reboot is known dead. */
  boot?: string;
  /** Linux: start time of the process in clock ticks since boot, so a reused pid is not taken for the owner. */
  start?: string;
  since: string;
  /** For a run into a new --out: the absolute path it will become. */
  target?: string;
}

function readText(path: string): string | undefined {
  try {
    return readFileSync(path, 'utf8');
  } catch {
    return undefined;
  }
}

/** Field 22 of /proc/<pid>/stat (starttime) and field 3 (state); the command name may hold spaces and parens. */
function procStat(pid: number): { state: string; start: string } | undefined {
  const s = readText(`/proc/${pid}/stat`);
  if (s === undefined) return undefined;
  const f = s.slice(s.lastIndexOf(')') + 2).split(' ');
  return { state: f[0], start: f[19] };
}

function me(target?: string): Owner {
  return {
    pid: process.pid,
    host: hostname(),
    boot: readText('/proc/sys/kernel/random/boot_id')?.trim(),
    start: procStat(process.pid)?.start,
    since: new Date().toISOString(),
    ...(target !== undefined && { target }),
  };
}

function readOwner(dir: string): Owner | undefined {
  try {
    const o = JSON.parse(readFileSync(join(dir, 'owner.json'), 'utf8')) as Owner;
    return Number.isSafeInteger(o.pid) && typeof o.host === 'string' ? o : undefined;
  } catch {
    return undefined;
  }
}

/**
 * 'dead' only when certain: the pid does not exist, is a zombie, started at another time (reused) or before the
 * last boot. A process on another host cannot be checked from here: 'unknown', which callers treat as alive.
 */
function liveness(o: Pick<Owner, 'pid' | 'host' | 'boot' | 'start'>): 'alive' | 'dead' | 'unknown' {
  if (o.host !== hostname()) return 'unknown';
  const boot = readText('/proc/sys/kernel/random/boot_id')?.trim();
  if (o.boot && boot && o.boot !== boot) return 'dead';
  try {
    process.kill(o.pid, 0);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === 'ESRCH') return 'dead';
  }
  const stat = procStat(o.pid);
  if (stat && (stat.state === 'Z' || (o.start !== undefined && stat.start !== o.start))) return 'dead';
  return 'alive';
}

/**
 * ioError, also for a TreepackError that wraps a system error (writeFileAtomic's, which names the file inside
 * staging): the user should read which directory they gave could not be written, and why.
 */
function fsFailure(err: unknown, path: string, action: string): unknown {
  const cause = err instanceof TreepackError && err.code === 'E_IO' ? err.cause : err;
  const wrapped = ioError(cause, path, action);
  return wrapped === cause ? err : wrapped;
}

const fsCall = <T>(path: string, action: string, f: () => T): T => {
  try {
    return f();
  } catch (err) {
    throw fsFailure(err, path, action);
  }
};

/** Recursive removal that reports instead of throwing: cleanup must never hide the error that caused it. */
function removeQuietly(
  path: string,
  notes: string[],
  what: string,
  remove = (p: string) => rmSync(p, { recursive: true, force: true }),
): void {
  try {
    remove(path);
  } catch (err) {
    notes.push(`could not remove ${what} ${path}: ${(err as Error).message}`);
  }
}

const tempPath = (parent: string) => join(parent, `.treepack-tmp-${process.pid}-${randomBytes(6).toString('hex')}`);

/**
 * Removes a staging directory by renaming it to a pid-named temporary first: a kill -9 in the middle of a recursive
 * remove would otherwise leave a claim without its owner.json, which every later run must take for a live writer.
 */
function removeStaging(dir: string): void {
  const tmp = tempPath(dirname(dir));
  try {
    renameSync(dir, tmp);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === 'ENOENT') return;
    throw err;
  }
  rmSync(tmp, { recursive: true, force: true });
}

interface Scan {
  staging: Map<number, string>;
  gens: Set<number>;
  /** Entries named after a pid (temp files, legacy staging). */
  pidNamed: { name: string; pid: number }[];
  /** First path components the committed manifest names (gen-NNNNNN, or files of the legacy flat layout). */
  committed: { generation: number; names: Set<string> | undefined; bytes: string | undefined };
}

function scan(out: string): Scan {
  const entries = fsCall(out, 'list the output directory', () => readdirSync(out));
  const s: Scan = { staging: new Map(), gens: new Set(), pidNamed: [], committed: readCommitted(out) };
  for (const name of entries) {
    let m: RegExpExecArray | null;
    if ((m = STAGING.exec(name))) s.staging.set(Number(m[1]), name);
    else if ((m = GEN.exec(name))) s.gens.add(Number(m[1]));
    else if ((m = PID_NAMED.exec(name) ?? LEGACY_STAGING.exec(name))) s.pidNamed.push({ name, pid: Number(m[1]) });
  }
  return s;
}

/**
 * The committed manifest's generation (0 for none or the legacy layout) and the top-level names its files live
 * under. Unreadable or not ours: `names` undefined, and garbage collection keeps every generation.
 */
function readCommitted(out: string): Scan['committed'] {
  let bytes: string;
  try {
    bytes = readFileSync(join(out, MANIFEST_FILE), 'utf8');
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === 'ENOENT') return { generation: 0, names: new Set(), bytes: undefined };
    throw ioError(err, join(out, MANIFEST_FILE), 'read the committed manifest');
  }
  try {
    const doc = JSON.parse(bytes) as { generation?: unknown; micro_batches?: { file?: unknown }[] };
    const generation = Number.isSafeInteger(doc.generation) && (doc.generation as number) > 0 ? (doc.generation as number) : 0;
    const names = new Set<string>();
    for (const e of doc.micro_batches ?? []) if (typeof e?.file === 'string') names.add(e.file.split('/')[0]);
    return { generation, names, bytes };
  } catch {
    return { generation: 0, names: undefined, bytes };
  }
}

const highest = (s: Scan) => Math.max(s.committed.generation, ...s.gens, ...s.staging.keys(), 0);

/** One run publishing into an output directory: files are staged, then committed with the manifest, or aborted. */
export interface PublishRun {
  /** The output directory, as given. */
  readonly out: string;
  /** The generation this run will commit (1 + the highest number in --out). */
  readonly generation: number;
  /** What the run found and did that a user may want to know: stale staging removed, garbage it could not remove. */
  readonly notes: readonly string[];
  /**
   * Writes the file `name` into staging with `write(path)` (e.g. writeMicroBatch) and returns its path relative to
   * --out once committed: what the manifest must call it. A file-system failure is E_IO naming --out and `name`.
   */
  stage(name: string, write: (path: string) => void): string;
  /**
   * Makes the staged files and `manifest` (the bytes of manifest.json, which should record `generation`) the
   * content of --out in one atomic step, then removes generations older than the previous one. Throws (and
   * aborts) if --out changed since the run opened.
   */
  commit(manifest: Uint8Array): void;
  /** Removes everything the run made; --out is left as it was. Safe to call twice, and after commit (no-op). */
  abort(): void;
}

/**
 * Opens a run into `out`: claims the next generation (the lock) and cleans what dead writers left. Throws
 * E_IO naming the path when --out is unusable (not a directory, read-only, no permission, no space) or another
 * live process is writing to it.
 */
export function openPublish(out: string): PublishRun {
  let st;
  try {
    st = statSync(out);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'ENOENT') throw ioError(err, out, 'use the output directory');
  }
  if (st && !st.isDirectory()) throw new TreepackError('E_IO', 'the output path exists and is not a directory', { file: out });
  return st ? openExisting(out) : openNew(out);
}

function ownerLine(o: Owner | undefined, dir: string): string {
  return o ? `pid ${o.pid} on ${o.host}, since ${o.since}` : `unknown owner (no ${join(dir, 'owner.json')})`;
}

/**
 * Builds a claim directory (owner.json + files/) under a temporary name in `parent` and renames it to `name`;
 * false if that name exists (another writer claimed it first).
 */
function claim(parent: string, name: string, owner: Owner): boolean {
  const tmp = tempPath(parent);
  try {
    fsCall(parent, 'create a staging directory in it', () => {
      // One level at a time: a recursive mkdir reports ENOENT, not the reason (EROFS, EACCES), when the first fails.
      mkdirSync(tmp);
      mkdirSync(join(tmp, 'files'));
      writeFileAtomic(join(tmp, 'owner.json'), JSON.stringify(owner, null, 2) + '\n');
    });
    try {
      renameSync(tmp, join(parent, name));
      return true;
    } catch (err) {
      const code = (err as NodeJS.ErrnoException).code;
      if (code === 'ENOTEMPTY' || code === 'EEXIST') return false;
      throw ioError(err, join(parent, name), 'claim the next generation');
    }
  } finally {
    rmSync(tmp, { recursive: true, force: true });
  }
}

function openExisting(out: string): PublishRun {
  const notes: string[] = [];
  let base: Scan | undefined;
  let n = 0;
  // A second pass only when another writer claimed the same number in between; it then finds that writer alive.
  for (let attempt = 0; attempt < 3 && n === 0; attempt++) {
    base = scan(out);
    for (const [, name] of base.staging) {
      const owner = readOwner(join(out, name));
      if (!owner || liveness(owner) !== 'dead') {
        throw new TreepackError(
          'E_IO',
          `another treepack run is writing this directory (${ownerLine(owner, join(out, name))}); wait for it to finish, or remove ${join(out, name)} if that process is gone`,
          { file: out },
        );
      }
    }
    const want = highest(base) + 1;
    if (!claim(out, stagingName(want), me())) continue;
    // Claims are made at 1 + the highest number seen: a generation at ours, or a claim above it, means another
    // writer committed or claimed after the scan; scan again.
    const now = scan(out);
    if (now.committed.generation >= want || [...now.gens].some((k) => k >= want) || [...now.staging.keys()].some((k) => k > want)) {
      removeStaging(join(out, stagingName(want)));
      continue;
    }
    n = want;
  }
  if (n === 0) throw new TreepackError('E_IO', 'another treepack run claimed this directory at the same moment', { file: out });
  const s = base!;
  const staging = join(out, stagingName(n));
  let genPublished = false;
  let done = false;

  // This run holds the claim: whatever a dead writer left can go.
  for (const [k, name] of s.staging) {
    const owner = readOwner(join(out, name));
    notes.push(`removed staging left by a dead run (${ownerLine(owner, join(out, name))}): ${join(out, name)}`);
    removeQuietly(join(out, name), notes, 'stale staging', removeStaging);
    s.staging.delete(k);
  }
  for (const { name, pid } of s.pidNamed) {
    if (pid === process.pid || liveness({ pid, host: hostname() }) !== 'dead') continue;
    notes.push(`removed ${join(out, name)} left by dead process ${pid}`);
    removeQuietly(join(out, name), notes, 'stale temporary');
  }
  cleanNewLeftovers(dirname(resolve(out)), notes);
  // A generation above the committed one with no live writer is a publish that died before its commit point.
  for (const k of s.gens) {
    if (k > s.committed.generation) {
      notes.push(`removed ${join(out, genName(k))}, never committed (its writer died while publishing)`);
      removeQuietly(join(out, genName(k)), notes, 'uncommitted generation');
    }
  }

  const abort = () => {
    if (done) return;
    done = true;
    if (genPublished) rmSync(join(out, genName(n)), { recursive: true, force: true });
    removeStaging(staging);
  };

  return {
    out,
    generation: n,
    notes,
    stage: (name, write) => stageFile(out, join(staging, 'files', name), name, genName(n), write),
    abort,
    commit(manifest) {
      if (done) throw new TreepackError('E_ARG', 'this publish run was already committed or aborted', { file: out });
      try {
        const now = scan(out);
        if (now.committed.bytes !== s.committed.bytes || highest(now) > n) {
          throw new TreepackError(
            'E_IO',
            'another writer published to this directory while this run was staging; this run published nothing',
            { file: out },
          );
        }
        fsCall(out, 'write the manifest', () => writeFileAtomic(join(staging, MANIFEST_FILE), manifest));
        fsCall(join(out, genName(n)), 'publish the new generation', () => renameSync(join(staging, 'files'), join(out, genName(n))));
        genPublished = true;
        fsCall(out, 'sync the output directory', () => syncDirectory(out));
        fsCall(join(out, MANIFEST_FILE), 'commit the manifest', () => renameSync(join(staging, MANIFEST_FILE), join(out, MANIFEST_FILE)));
        genPublished = false;
        done = true;
        fsCall(out, 'sync the output directory', () => syncDirectory(out));
      } catch (err) {
        abort();
        throw err;
      }
      collectGarbage(out, n, s.committed.names, notes);
      removeQuietly(staging, notes, 'own staging', removeStaging);
    },
  };
}

/**
 * Keeps the new generation and whatever the previous manifest named (a reader may have read it just before the
 * swap); removes older generations and legacy flat files. Never fails the committed run: problems become notes.
 */
function collectGarbage(out: string, n: number, previous: Set<string> | undefined, notes: string[]): void {
  if (previous === undefined) {
    notes.push(`kept every earlier generation in ${out}: the previous manifest could not be read`);
    return;
  }
  let entries: string[];
  try {
    entries = readdirSync(out);
  } catch (err) {
    notes.push(`could not list ${out} to remove old generations: ${(err as Error).message}`);
    return;
  }
  for (const name of entries) {
    const m = GEN.exec(name);
    const old = m ? Number(m[1]) < n : LEGACY_FILE.test(name);
    if (old && !previous.has(name)) removeQuietly(join(out, name), notes, 'old generation');
  }
}

function stageFile(out: string, path: string, name: string, gen: string, write: (path: string) => void): string {
  if (typeof name !== 'string' || !/^[^/\\]+$/.test(name) || name === '.' || name === '..')
    throw argError('a staged file name', 'a plain file name', name);
  try {
    write(path);
  } catch (err) {
    throw fsFailure(err, out, `write ${name}`);
  }
  return `${gen}/${name}`;
}

/** The nearest ancestor of `path` that exists (the run stages there, on the file system --out will be on). */
function existingAncestor(path: string): string {
  let dir = dirname(path);
  while (!existsSync(dir) && dirname(dir) !== dir) dir = dirname(dir);
  return dir;
}

function openNew(out: string): PublishRun {
  const target = resolve(out);
  const notes: string[] = [];
  const parent = existingAncestor(target);
  const ancestorStat = fsCall(parent, 'use the output directory', () => statSync(parent));
  if (!ancestorStat.isDirectory())
    throw new TreepackError('E_IO', `cannot create the output directory: ${parent} is not a directory`, { file: out });
  cleanNewLeftovers(parent, notes);
  const tmp = join(parent, `.treepack-new-${process.pid}-${randomBytes(6).toString('hex')}`);
  let done = false;
  const abort = () => {
    if (done) return;
    done = true;
    rmSync(tmp, { recursive: true, force: true });
  };
  try {
    fsCall(parent, 'create the output directory in it', () => {
      mkdirSync(tmp);
      writeFileAtomic(join(tmp, 'owner.json'), JSON.stringify(me(target), null, 2) + '\n');
      mkdirSync(join(tmp, 'out', genName(1)), { recursive: true });
    });
  } catch (err) {
    abort();
    throw err;
  }
  return {
    out,
    generation: 1,
    notes,
    stage: (name, write) => stageFile(out, join(tmp, 'out', genName(1), name), name, genName(1), write),
    abort,
    commit(manifest) {
      if (done) throw new TreepackError('E_ARG', 'this publish run was already committed or aborted', { file: out });
      try {
        fsCall(out, 'write the manifest', () => writeFileAtomic(join(tmp, 'out', MANIFEST_FILE), manifest));
        fsCall(dirname(target), 'create the parent of the output directory', () => mkdirSync(dirname(target), { recursive: true }));
        try {
          renameSync(join(tmp, 'out'), target);
        } catch (err) {
          const code = (err as NodeJS.ErrnoException).code;
          if (code === 'ENOTEMPTY' || code === 'EEXIST') {
            throw new TreepackError(
              'E_IO',
              'another writer created this directory while this run was staging; this run published nothing',
              { file: out },
            );
          }
          throw ioError(err, out, 'create the output directory');
        }
        done = true;
        fsCall(dirname(target), 'sync the parent directory', () => syncDirectory(dirname(target)));
      } catch (err) {
        abort();
        throw err;
      }
      removeQuietly(tmp, notes, 'own staging');
    },
  };
}

/** Runs into a new --out in `parent` that died before (or just after) creating it. */
function cleanNewLeftovers(parent: string, notes: string[]): void {
  let entries: string[];
  try {
    entries = readdirSync(parent);
  } catch {
    return; // staging there fails next, with the reason
  }
  for (const name of entries) {
    const m = /^\.treepack-new-(\d+)-/.exec(name);
    if (!m) continue;
    // Killed before owner.json was written: the pid in the name is all there is.
    const owner = readOwner(join(parent, name)) ?? { pid: Number(m[1]), host: hostname() };
    if (owner.pid === process.pid || liveness(owner) !== 'dead') continue;
    const into = 'target' in owner && owner.target ? ` into ${owner.target}` : '';
    notes.push(`removed staging left by a dead run${into} (pid ${owner.pid}): ${join(parent, name)}`);
    removeQuietly(join(parent, name), notes, 'stale staging');
  }
}
