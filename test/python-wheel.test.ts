/**
 * The Python package as a user installs it: `pip wheel ./python` (scikit-build-core compiles the C core into the
 * package), then the wheel installed into a clean venv outside the checkout (`python3 -m venv`, numpy and
 * safetensors from the index), used from the temp directory: pack_sequences with per-token fields, loss_numpy
 * against a float64 formula and the fixture test/fixtures/loss_reference.json, load of a TypeScript-written file and of
 * a safetensors-written one, the block arrays, the numpy unit suites, and a missing CUDA library reported, not fatal
 * (test/helpers/wheel_check.py). Skipped with the reason where python3, its venv or pip, or a C++ compiler is
 * missing; TREEPACK_REQUIRE_WHEEL=1 (CI) fails instead.
 */
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readdirSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, describe, expect, it } from 'vitest';
import { writeMicroBatch } from '../src/io/microbatch.js';
import { FORMAT, type MicroBatch } from '../src/pack/contract.js';
import { packForest } from '../src/pack/forest.js';
import { csr, randomBatch } from './helpers/sequences.js';

const root = fileURLToPath(new URL('..', import.meta.url));
const fixture = join(root, 'test', 'fixtures', 'loss_reference.json');
const pip = ['--disable-pip-version-check', '--retries', '0', '--timeout', '5'];

function missing(): string {
  const runs = (cmd: string, args: string[]) => {
    const r = spawnSync(cmd, args, { encoding: 'utf8', timeout: 60_000 });
    return !r.error && r.status === 0;
  };
  if (!runs('python3', ['-c', 'import venv, ensurepip'])) return 'python3 with venv and ensurepip not found';
  if (!runs('python3', ['-m', 'pip', '--version'])) return 'python3 has no pip';
  if (!['c++', 'g++', 'clang++'].some((cc) => runs(cc, ['--version']))) return 'no C++ compiler (c++, g++, clang++) to build the C core';
  return '';
}

const skipReason = missing();
if (skipReason && process.env.TREEPACK_REQUIRE_WHEEL === '1')
  throw new Error(`test/python-wheel.test.ts: TREEPACK_REQUIRE_WHEEL=1 but ${skipReason}`);
if (skipReason) console.log(`test/python-wheel.test.ts skipped: ${skipReason}`);

describe.skipIf(skipReason !== '')('the treepack wheel in a clean venv', () => {
  const dir = mkdtempSync(join(tmpdir(), 'treepack-wheel-'));
  afterAll(() => rmSync(dir, { recursive: true, force: true }));
  const run = (cmd: string, args: string[], opts: { input?: string; env?: Record<string, string> } = {}) => {
    const env: NodeJS.ProcessEnv = { ...process.env, PYTHONDONTWRITEBYTECODE: '1', ...opts.env };
    delete env.PYTHONPATH;
    const r = spawnSync(cmd, args, { cwd: dir, encoding: 'utf8', timeout: 600_000, maxBuffer: 64 << 20, input: opts.input, env });
    expect(r.status, `${cmd} ${args.join(' ')}\n${r.stdout.slice(-2000)}\n${r.stderr.slice(-4000)}`).toBe(0);
    return r;
  };

  it('builds, installs outside the checkout and works from there', { timeout: 900_000 }, () => {
    const start = performance.now();
    run('python3', ['-m', 'pip', 'wheel', ...pip, '-q', '--no-deps', '-w', join(dir, 'dist'), join(root, 'python')]);
    const seconds = (performance.now() - start) / 1000;
    const wheels = readdirSync(join(dir, 'dist')).filter((f) => f.endsWith('.whl'));
    expect(wheels).toHaveLength(1);
    const wheel = join(dir, 'dist', wheels[0]);
    console.log(
      `treepack wheel: ${wheels[0]}, ${(statSync(wheel).size / 1024).toFixed(0)} KiB, built in ${seconds.toFixed(1)} s (pip wheel, isolated build)`,
    );
    const venv = join(dir, 'venv');
    const python = join(venv, 'bin', 'python');
    run('python3', ['-m', 'venv', venv]);
    run(python, ['-m', 'pip', 'install', ...pip, '-q', wheel]);

    const seqs = csr(randomBatch(11, { count: 30, maxLen: 20 }));
    const forest = packForest(seqs);
    const M = seqs.tokens.length,
      S = seqs.offsets.length - 1;
    const batch: MicroBatch = {
      ...forest,
      loss_mask: Uint8Array.from({ length: M }, (_, k) => (seqs.offsets.includes(k) ? 0 : 1)),
      advantages: Float32Array.from({ length: M }, (_, k) => (k % 7) / 7 - 0.5),
      meta: {
        format: FORMAT,
        num_sequences: S,
        num_tokens_naive: M,
        num_tokens_packed: forest.input_ids.length,
        tokenizer: 't',
        sequence_ids: Array.from({ length: S }, (_, i) => String(i)),
      },
    };
    const tsFile = join(dir, 'ts.safetensors');
    writeMicroBatch(tsFile, batch);
    const tsArrays = Object.fromEntries(
      ['input_ids', 'parent', 'subtree_end', 'seq_offsets', 'seq_positions', 'loss_mask', 'advantages'].map((n) => [
        n,
        Array.from(batch[n as keyof MicroBatch] as ArrayLike<number>),
      ]),
    );
    const request = { checkout: root, ts_file: tsFile, ts_arrays: tsArrays, fixture };
    const res = run(python, [join(root, 'test', 'helpers', 'wheel_check.py')], { input: JSON.stringify(request) });
    const out = JSON.parse(res.stdout.trim().split('\n').pop()!) as {
      module: string;
      core: string;
      cuda: string;
      packed: number[];
      fixture_aggregations: number;
    };
    console.log(`installed at ${out.module}; CUDA: ${out.cuda}`);
    expect(out.module.startsWith(venv)).toBe(true);
    expect(out.packed[1]).toBeLessThan(out.packed[0]);
    expect(out.fixture_aggregations).toBeGreaterThan(0);

    // The numpy suites against this install (the torch ones skip: no torch in this venv, by design, so CI's
    // TREEPACK_REQUIRE_TORCH does not apply here; test/python.test.ts runs them where torch is required).
    const suites = run(python, ['-m', 'unittest', 'discover', '-v', '-s', join(root, 'python', 'tests')], {
      env: { TREEPACK_REQUIRE_TORCH: '' },
    });
    expect(suites.stderr).toMatch(/\nOK\b/);
    expect(suites.stderr).toMatch(/test_values_land_at_their_occurrence .* \.\.\. ok/);
  });
});
