/**
 * scripts/gpu-check.sh --dry, as CI runs it on a host without a device: every step that runs without one passes (the
 * C core's CMake build, the CUDA-vs-core driver against the core with its planted faults caught, the mask files
 * test_flex_gpu.py reads, checked by test_flex.py on the CPU, the packed-vs-naive training step at a tiny size on CPU
 * in float32), every device step is marked NEEDS-DEVICE, and no step FAILs. The negative control: a run whose budget
 * is already spent reports every step FAIL and exits non-zero, so a PASS here is the steps' own.
 */
import { spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { QWEN3_SHAPES, totalFlops, work } from '../bench/cost-model.js';
import { installed, pythonFor } from './helpers/python.js';

const root = resolve(__dirname, '..');
const py = pythonFor('test/gpu-check.test.ts', 'torch');
const DRY_STEPS = ['env', 'build-core', 'cuda-vs-core-selftest', 'mask-files', 'train-step-tiny'];
const DEVICE_STEPS = [
  'build-cuda',
  'cuda-vs-core',
  'fla-install',
  'test-loss',
  'test-flex-gpu',
  'test-trainer-cuda',
  'test-gpu',
  'test-fla',
  'train-step-8k',
  'train-step-32k',
  'train-exact-f32',
];

/** The summary's step lines: name → [status, figures]. */
function steps(summary: string): Map<string, [string, string]> {
  const out = new Map<string, [string, string]>();
  for (const line of summary
    .split('\n')
    .slice(3)
    .filter((l) => !l.startsWith('result: '))) {
    const m = /^(\S+)\s+(PASS|FAIL|NEEDS-DEVICE)\s+\S+\s+(.*)$/.exec(line);
    if (m) out.set(m[1], [m[2], m[3]]);
  }
  return out;
}

describe.skipIf(py.skipReason !== '')('scripts/gpu-check.sh --dry', () => {
  const dirs: string[] = [];
  const run = (env: Record<string, string>) => {
    const out = mkdtempSync(join(tmpdir(), 'treepack-gpu-check-'));
    dirs.push(out);
    const res = spawnSync('bash', [join(root, 'scripts', 'gpu-check.sh'), '--dry'], {
      cwd: root,
      encoding: 'utf8',
      timeout: 580_000,
      env: { ...process.env, OUT: out, PYTHON: installed().python!, ...env },
    });
    const summary = existsSync(join(out, 'summary.txt')) ? readFileSync(join(out, 'summary.txt'), 'utf8') : '';
    return { res, out, summary };
  };
  afterAll(() => dirs.forEach((d) => rmSync(d, { recursive: true, force: true })));

  it('passes every step a CPU host runs and marks the device steps NEEDS-DEVICE', { timeout: 600_000 }, () => {
    const { res, out, summary } = run({});
    expect(res.status, `${summary}\n${res.stderr}`).toBe(0);
    const got = steps(summary);
    expect([...got.keys()].sort()).toEqual([...DRY_STEPS, ...DEVICE_STEPS].sort());
    for (const name of DRY_STEPS) {
      expect(got.get(name)?.[0], `${name}: ${got.get(name)?.[1]}`).toBe('PASS');
      expect(existsSync(join(out, `${name}.log`)), name).toBe(true);
    }
    for (const name of DEVICE_STEPS) expect(got.get(name)?.[0], name).toBe('NEEDS-DEVICE');
    expect(summary).toMatch(/^result: PASS \(5 passed, 0 failed, 11 need a device\)/m);
    expect(got.get('cuda-vs-core-selftest')?.[1]).toMatch(/0 differences, every planted fault caught/);
    type Figures = { sides: Record<string, { trainable: number; step_s: number }>; mismatches: object };
    const tiny = JSON.parse(readFileSync(join(out, 'train-step-tiny.json'), 'utf8')) as Figures;
    expect(tiny.mismatches).toEqual({});
    expect(tiny.sides.naive.trainable).toBe(tiny.sides.packed.trainable);
    expect(tiny.sides.packed.trainable).toBeGreaterThan(0);
  });

  it('fails every step, and exits non-zero, when the budget is spent', { timeout: 120_000 }, () => {
    const { res, summary } = run({ TREEPACK_GPU_CHECK_BUDGET_S: '0' });
    expect(res.status).toBe(1);
    const got = steps(summary);
    for (const name of DRY_STEPS) expect(got.get(name), name).toEqual(['FAIL', expect.stringContaining('budget is spent')]);
    expect(summary).toMatch(/^result: FAIL \(0 passed, 5 failed, 11 need a device\)/m);
  });

  it("counts a step's model FLOPs as the bench's cost model does (bench/step.py model_flops = cost-model.ts work)", () => {
    // gpu-check runs without node, so the formula is restated in Python; this holds the two to one value.
    const shape = QWEN3_SHAPES[0];
    const f = {
      micro_batches: 3,
      tokens: 20_000,
      pad_tokens: 0,
      occurrences: 60_000,
      trainable: 30_000,
      pairs: 41_000_000,
      blocks: 0,
      full_blocks: 0,
      executed_blocks: 0,
      scored_rows: 9_000,
      max_tokens: 8_000,
    };
    const code =
      'import importlib.util, json, sys\n' +
      `spec = importlib.util.spec_from_file_location("bench_step", ${JSON.stringify(join(root, 'bench', 'step.py'))})\n` +
      'm = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n' +
      'a = json.loads(sys.argv[1]); print(m.model_flops(a["f"], a["shape"], a["vocab"]))';
    const res = py.run(['-c', code, JSON.stringify({ f, shape, vocab: 5000 })], { timeout: 110_000 });
    expect(res.status, res.stderr).toBe(0);
    const want = totalFlops(work(f, shape, 5000, 128, 2));
    expect(Number(res.stdout.trim()) / want).toBeCloseTo(1, 12);
  });
});
