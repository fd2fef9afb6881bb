/**
 * The output directory (src/io/publish.ts, src/io/manifest.ts): generations, the commit point, the lock and
 * compare-and-swap, cleanup of what dead writers left, and unusable paths (a file, under a file, read-only,
 * no permission, a full disk) as one E_IO line naming the path, in the library and through `treepack pack`.
 */
import { execFileSync, spawn, spawnSync } from 'node:child_process';
import { chmodSync, existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { hostname, tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { microBatchPaths, readManifest, readMicroBatches } from '../src/io/manifest.js';
import { writeMicroBatch } from '../src/io/microbatch.js';
import { openPublish, type PublishRun } from '../src/io/publish.js';
import { generateTokenSamples } from '../bench/dataset.js';
import { BIN } from './helpers/cli.js';
import { differences, snapshot } from './helpers/faults.js';
import { randomMicroBatch } from './helpers/sequences.js';

const dir = mkdtempSync(join(tmpdir(), 'treepack-publish-'));
chmodSync(dir, 0o755); // the permission cases run the CLI as another user
afterAll(() => rmSync(dir, { recursive: true, force: true }));
let seq = 0;
const fresh = () => join(dir, `case-${seq++}`);

const manifestOf = (run: PublishRun, entries: object[]) =>
  Buffer.from(JSON.stringify({ format: 'treepack/1', generation: run.generation, micro_batches: entries }));

/** Writes `n` small micro-batches through `run` and commits; returns the file bytes in manifest order. */
function publish(run: PublishRun, n: number, seed = 1): Buffer[] {
  const entries = [];
  for (let i = 0; i < n; i++) {
    const { batch } = randomMicroBatch(seed * 100 + i);
    const name = `microbatch-${String(i).padStart(5, '0')}.safetensors`;
    entries.push({
      file: run.stage(name, (p) => writeMicroBatch(p, batch)),
      sequences: batch.meta.num_sequences,
      naive_tokens: batch.meta.num_tokens_naive,
      packed_tokens: batch.meta.num_tokens_packed,
    });
  }
  run.commit(manifestOf(run, entries));
  return microBatchPaths(run.out).map((p) => readFileSync(p));
}

const ioError = (file: string, message: RegExp) =>
  expect.objectContaining({ code: 'E_IO', where: { file }, message: expect.stringMatching(message) });

/** A pid that surely belongs to no process: one that just exited (and was reaped). */
function deadPid(): number {
  return Number(execFileSync(process.execPath, ['-e', 'process.stdout.write(String(process.pid))'], { encoding: 'utf8' }));
}

describe('generations and the commit point', () => {
  it('a new --out appears whole at commit; manifest names gen-000001 files', () => {
    const out = join(fresh(), 'nested', 'out');
    const run = openPublish(out);
    expect(existsSync(join(out, '..'))).toBe(false); // not even the parents before the commit
    const bytes = publish(run, 3);
    expect(readdirSync(out).sort()).toEqual(['gen-000001', 'manifest.json']);
    const m = readManifest(out);
    expect(m.generation).toBe(1);
    expect(m.micro_batches.map((e) => e.file)).toEqual([0, 1, 2].map((i) => `gen-000001/microbatch-0000${i}.safetensors`));
    expect([...readMicroBatches(out)].map((mb) => mb.entry.file)).toEqual(m.micro_batches.map((e) => e.file));
    expect(bytes.length).toBe(3);
    expect(readdirSync(join(out, '..', '..'))).toEqual(['nested']); // no staging left beside it
  });

  it('keeps the previous generation for readers of the previous manifest, removes older ones', () => {
    const out = fresh();
    publish(openPublish(out), 2, 1);
    const first = snapshot(out);
    publish(openPublish(out), 1, 2);
    expect(readdirSync(out).sort()).toEqual(['gen-000001', 'gen-000002', 'manifest.json']);
    for (const [rel, bytes] of first) if (rel.startsWith('gen-000001/')) expect(readFileSync(join(out, rel)).equals(bytes)).toBe(true);
    publish(openPublish(out), 1, 3);
    expect(readdirSync(out).sort()).toEqual(['gen-000002', 'gen-000003', 'manifest.json']);
    expect(readManifest(out).generation).toBe(3);
  });

  it('takes over a directory of an older treepack (flat files): they are the previous generation', () => {
    const out = fresh();
    mkdirSync(out);
    const { batch } = randomMicroBatch(5);
    writeMicroBatch(join(out, 'microbatch-00000.safetensors'), batch);
    writeFileSync(
      join(out, 'manifest.json'),
      JSON.stringify({
        format: 'treepack/1',
        micro_batches: [{ file: 'microbatch-00000.safetensors', sequences: 1, naive_tokens: 1, packed_tokens: 1 }],
      }),
    );
    publish(openPublish(out), 1);
    expect(readdirSync(out).sort()).toEqual(['gen-000001', 'manifest.json', 'microbatch-00000.safetensors']);
    publish(openPublish(out), 1);
    expect(readdirSync(out).sort()).toEqual(['gen-000001', 'gen-000002', 'manifest.json']);
  });

  it('abort leaves --out exactly as it was, and a new --out uncreated', () => {
    const out = fresh();
    publish(openPublish(out), 2);
    const before = snapshot(out);
    const run = openPublish(out);
    run.stage('microbatch-00000.safetensors', (p) => writeMicroBatch(p, randomMicroBatch(9).batch));
    for (const name of ['../escape.safetensors', 'a/b', '..', '']) {
      expect(() => run.stage(name, () => {})).toThrow(expect.objectContaining({ code: 'E_ARG' }));
    }
    run.abort();
    run.abort();
    expect(differences(snapshot(out), before)).toEqual([]);
    expect(() => run.commit(manifestOf(run, []))).toThrow(/already committed or aborted/);

    const parent = fresh();
    mkdirSync(parent);
    const run2 = openPublish(join(parent, 'out'));
    run2.stage('x.safetensors', (p) => writeMicroBatch(p, randomMicroBatch(9).batch));
    run2.abort();
    expect(readdirSync(parent)).toEqual([]);
  });
});

describe('concurrent writers', () => {
  it('a second writer is refused while the first is open, naming the owner', () => {
    const out = fresh();
    publish(openPublish(out), 1);
    const first = openPublish(out);
    expect(() => openPublish(out)).toThrow(
      ioError(out, new RegExp(`another treepack run is writing this directory \\(pid ${process.pid} on `)),
    );
    publish(first, 2);
    publish(openPublish(out), 1); // released by the commit
  });

  it('commit is a compare-and-swap: a manifest changed since the run opened wins, and the run publishes nothing', () => {
    const out = fresh();
    publish(openPublish(out), 1);
    const run = openPublish(out);
    run.stage('a.safetensors', (p) => writeMicroBatch(p, randomMicroBatch(1).batch));
    writeFileSync(join(out, 'manifest.json'), JSON.stringify({ format: 'treepack/1', generation: 1, micro_batches: [] }));
    const before = new Map([...snapshot(out)].filter(([rel]) => !rel.startsWith('.treepack-staging-')));
    expect(() => run.commit(manifestOf(run, []))).toThrow(
      ioError(out, /another writer published to this directory while this run was staging/),
    );
    expect(differences(snapshot(out), before)).toEqual([]);
  });

  it('two runs into one new --out: the second to commit fails and leaves the first whole', () => {
    const parent = fresh();
    mkdirSync(parent);
    const out = join(parent, 'out');
    const a = openPublish(out);
    const b = openPublish(out);
    const bytes = publish(a, 2, 1);
    expect(() => publish(b, 1, 2)).toThrow(ioError(out, /another writer created this directory while this run was staging/));
    expect(microBatchPaths(out).map((p) => readFileSync(p))).toEqual(bytes);
    expect(readdirSync(parent)).toEqual(['out']);
  });
});

describe('what dead writers leave', () => {
  it('staging of a dead run is removed by the next run and reported', () => {
    const out = fresh();
    publish(openPublish(out), 1);
    const pid = deadPid();
    const stale = join(out, '.treepack-staging-gen-000002');
    mkdirSync(join(stale, 'files'), { recursive: true });
    writeFileSync(join(stale, 'owner.json'), JSON.stringify({ pid, host: hostname(), since: 'then' }));
    writeFileSync(join(stale, 'files', 'big.safetensors'), Buffer.alloc(1 << 16));
    writeFileSync(join(out, `.treepack-tmp-${pid}-abc`), '');
    mkdirSync(join(out, `.treepack-staging-${pid}`)); // an older treepack's staging
    mkdirSync(join(out, 'gen-000002')); // renamed into place, then the writer died before the manifest
    const run = openPublish(out);
    expect(run.generation).toBe(3);
    expect(run.notes.join('\n')).toMatch(
      new RegExp(`removed staging left by a dead run \\(pid ${pid} on .*\\.treepack-staging-gen-000002`),
    );
    expect(run.notes.join('\n')).toMatch(/gen-000002, never committed/);
    expect(readdirSync(out).sort()).toEqual(['.treepack-staging-gen-000003', 'gen-000001', 'manifest.json']);
    publish(run, 1);
    expect(readdirSync(out).sort()).toEqual(['gen-000001', 'gen-000003', 'manifest.json']);
  });

  it('a staging directory whose owner lives on another host is never taken for dead', () => {
    const out = fresh();
    publish(openPublish(out), 1);
    const other = join(out, '.treepack-staging-gen-000002');
    mkdirSync(other);
    writeFileSync(join(other, 'owner.json'), JSON.stringify({ pid: deadPid(), host: 'elsewhere', since: 'then' }));
    expect(() => openPublish(out)).toThrow(
      ioError(out, new RegExp(`pid \\d+ on elsewhere.*remove ${other.replaceAll('.', '\\.')} if that process is gone`)),
    );
  });

  it('a dead run into a new --out: its staging beside --out is removed by the next run', () => {
    const parent = fresh();
    mkdirSync(parent);
    const pid = deadPid();
    mkdirSync(join(parent, `.treepack-new-${pid}-abc`, 'out'), { recursive: true });
    const run = openPublish(join(parent, 'out'));
    expect(run.notes.join('\n')).toMatch(new RegExp(`removed staging left by a dead run \\(pid ${pid}\\)`));
    publish(run, 1);
    expect(readdirSync(parent)).toEqual(['out']);
  });
});

describe('the manifest as readers see it', () => {
  it('names only files inside the directory; a file disagreeing with its entry is from another run', () => {
    const out = fresh();
    publish(openPublish(out), 2);
    const m = readManifest(out);
    const write = (doc: unknown) => writeFileSync(join(out, 'manifest.json'), JSON.stringify(doc));
    for (const file of ['../x.safetensors', '/etc/passwd', './gen-000001/a', 'gen-000001//a', '']) {
      write({ ...m, micro_batches: [{ ...m.micro_batches[0], file }] });
      expect(() => readManifest(out)).toThrow(
        expect.objectContaining({ code: 'E_INPUT', where: { file: join(out, 'manifest.json'), field: 'micro_batches[0].file' } }),
      );
    }
    write({ ...m, micro_batches: [{ ...m.micro_batches[0], file: m.micro_batches[1].file }] });
    expect(() => [...readMicroBatches(out)]).toThrow(
      expect.objectContaining({ code: 'E_INPUT', message: expect.stringMatching(/a file of another run/) }),
    );
    write({ format: 'treepack/0', micro_batches: [] });
    expect(() => readManifest(out)).toThrow(
      expect.objectContaining({ code: 'E_INPUT', where: { file: join(out, 'manifest.json'), field: 'format' } }),
    );
    rmSync(join(out, 'manifest.json'));
    expect(() => readManifest(out)).toThrow(ioError(join(out, 'manifest.json'), /cannot read the manifest: ENOENT/));
  });
});

describe('an interrupted pack', () => {
  for (const signal of ['SIGINT', 'SIGTERM'] as const) {
    it(`${signal} while reading stdin: staging removed at once, --out as it was`, { timeout: 60_000 }, async () => {
      const out = fresh();
      publish(openPublish(out), 1);
      const before = snapshot(out);
      const child = spawn(process.execPath, [BIN, 'pack', '-', '--out', out, '--quiet'], { stdio: ['pipe', 'ignore', 'pipe'] });
      const exited = new Promise<NodeJS.Signals | null>((res) => child.on('close', (_code, sig) => res(sig)));
      child.stdin.write(readFileSync(input, 'utf8').split('\n')[0] + '\n'); // stdin stays open: the run waits for more
      while (!readdirSync(out).some((f) => f.startsWith('.treepack-staging-'))) await new Promise((res) => setTimeout(res, 20));
      child.kill(signal);
      expect(await exited).toBe(signal);
      expect(differences(snapshot(out), before)).toEqual([]);
    });
  }
});

// --- unusable paths, through the library and the CLI -------------------------------------------------------------

const root = process.getuid?.() === 0;
/** Root ignores permission bits: the permission cases run the CLI as nobody. */
const NOBODY = { uid: 65534, gid: 65534 };

function tryMount(target: string, options: string): boolean {
  mkdirSync(target, { recursive: true });
  return root && spawnSync('mount', ['-t', 'tmpfs', '-o', options, 'tmpfs', target]).status === 0;
}
const unmount = (target: string) => spawnSync('umount', [target]);

const input = join(dir, 'input.jsonl');
writeFileSync(
  input,
  [...generateTokenSamples({ groups: 3, seed: 4, minTurns: 2, maxTurns: 3 })].map((s) => JSON.stringify(s)).join('\n') + '\n',
);

function pack(out: string, opts: { uid?: number; gid?: number; shell?: string } = {}) {
  const args = [BIN, 'pack', input, '--out', out, '--quiet'];
  const r = opts.shell
    ? spawnSync('sh', ['-c', `${opts.shell}; exec "$0" "$@"`, process.execPath, ...args], { encoding: 'utf8' })
    : spawnSync(process.execPath, args, { encoding: 'utf8', uid: opts.uid, gid: opts.gid });
  return { code: r.status, stderr: r.stderr };
}

/** One line, `treepack pack: <path>: ...`, exit 1, no stack trace. */
function expectOneLine(r: { code: number | null; stderr: string }, path: string, reason: RegExp) {
  expect(r.code, r.stderr).toBe(1);
  expect(r.stderr.trim().split('\n')).toHaveLength(1);
  expect(r.stderr).toMatch(new RegExp(`^treepack pack: ${path.replaceAll('.', '\\.')}.*: `));
  expect(r.stderr).toMatch(reason);
}

describe('unusable --out: one line naming the path, exit 1, nothing changed', () => {
  it('a file, and a path under a file', { timeout: 60_000 }, () => {
    const file = join(fresh());
    writeFileSync(file, 'not a directory');
    expect(() => openPublish(file)).toThrow(ioError(file, /exists and is not a directory/));
    expectOneLine(pack(file), file, /exists and is not a directory/);
    expectOneLine(pack(join(file, 'sub')), join(file, 'sub'), /ENOTDIR: not a directory/);
    expect(readFileSync(file, 'utf8')).toBe('not a directory');
  });

  it('no permission: an unwritable parent (new --out) and an unwritable --out', { timeout: 60_000 }, (ctx) => {
    if (root && spawnSync(process.execPath, [BIN, '--version'], NOBODY).status !== 0) {
      return ctx.skip(`running as root, and user nobody cannot run ${BIN} (a checkout only root can read)`);
    }
    const parent = fresh();
    mkdirSync(parent);
    const out = join(parent, 'out');
    const user = root ? NOBODY : {};
    chmodSync(parent, 0o555);
    try {
      expectOneLine(pack(out, user), parent, /cannot create the output directory in it: EACCES: permission denied/);
      expect(readdirSync(parent)).toEqual([]);
    } finally {
      chmodSync(parent, 0o755);
    }
    expect(pack(out).code).toBe(0);
    const before = snapshot(out);
    chmodSync(out, 0o555);
    try {
      expectOneLine(pack(out, user), out, /EACCES: permission denied/);
    } finally {
      chmodSync(out, 0o755);
    }
    expect(differences(snapshot(out), before)).toEqual([]);
  });

  it.skipIf(!root)('a read-only file system (EROFS), existing and new --out', { timeout: 60_000 }, (ctx) => {
    const mnt = fresh();
    if (!tryMount(mnt, 'size=4m')) return ctx.skip('cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)');
    try {
      const out = join(mnt, 'out');
      expect(pack(out).code).toBe(0);
      const before = snapshot(out);
      expect(spawnSync('mount', ['-o', 'remount,ro', mnt]).status).toBe(0);
      expectOneLine(pack(out), out, /EROFS: read-only file system/);
      expectOneLine(pack(join(mnt, 'new')), mnt, /cannot create the output directory in it: EROFS: read-only file system/);
      expect(differences(snapshot(out), before)).toEqual([]);
      expect(readdirSync(mnt)).toEqual(['out']);
    } finally {
      unmount(mnt);
    }
  });

  it(
    'a full disk (ENOSPC on a 1 MiB tmpfs; else a file-size limit): the earlier run stays whole, staging is gone',
    { timeout: 60_000 },
    () => {
      const mnt = fresh();
      const mounted = tryMount(mnt, 'size=1m');
      // Without a mount, a file-size limit makes writes fail the same way (EFBIG), part way through the run.
      const limit = mounted ? {} : { shell: 'ulimit -f 64; trap "" XFSZ' };
      console.log(mounted ? 'full disk: 1 MiB tmpfs' : 'full disk: simulated with ulimit -f (cannot mount a tmpfs here)');
      try {
        const out = join(mnt, 'out');
        mkdirSync(out);
        publish(openPublish(out), 1, 3); // an earlier run small enough to fit, then one that cannot
        const before = snapshot(out);
        const r = pack(out, limit);
        expectOneLine(
          r,
          out,
          mounted
            ? /cannot write microbatch-00000\.safetensors: ENOSPC: no space left on device/
            : /cannot write microbatch-00000\.safetensors: EFBIG: file too large/,
        );
        expect(differences(snapshot(out), before)).toEqual([]);
      } finally {
        if (mounted) unmount(mnt);
      }
    },
  );
});
