/**
 * One ABI table across languages (src/backend/abi.ts): the generated C header and Python table are current; every
 * config field, set to each of its values, reaches every backend's kernel (each backend equals js on a pair of
 * configs that differ in that field alone, and js tells the two apart) and Python's ctypes struct; and the CPU and
 * CUDA C ABIs answer the same bad arguments with the same status, through the addons and through ctypes.
 */
import { spawnSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import { C_HEADERS, GENERATED, parseFunctions } from '../scripts/gen-abi.js';
import { ABI_HASH, configVector, LOSS_CONFIG_ENUMS, LOSS_CONFIG_NUMBERS, LOSS_METRICS_FIELDS, STATUSES } from '../src/backend/abi.js';
import { computeLoss, computeLossCompact, type BackendName } from '../src/backend/index.js';
import { cudaDeviceInfo, loadCuda, loadNative } from '../src/backend/native.js';
import { TreepackError } from '../src/errors.js';
import { buildCompactPlan, DEFAULT_LOSS_CONFIG, resolveLossConfig, type LossConfig, type LossResult } from '../src/loss/index.js';
import { lossReference } from '../src/loss/reference.js';
import type { MicroBatch } from '../src/pack/contract.js';
import { describeBackends } from './helpers/backends.js';
import { caught } from './helpers/errors.js';
import { close, randomLossCase } from './helpers/loss.js';
import { randomBatch } from './helpers/sequences.js';

/** The functions both addons (cpu, cuda) share, called here with arguments made to fail (methods: their parameters
 * compare bivariantly, so either addon's typed functions fit). */
interface Addon {
  maskDense(...args: unknown[]): unknown;
  maskBits(...args: unknown[]): unknown;
  maskBlocks(...args: unknown[]): unknown;
  loss(...args: unknown[]): unknown;
}

const root = fileURLToPath(new URL('..', import.meta.url));

describe('the ABI table', () => {
  it('generated files are current (npm run gen:abi)', () => {
    for (const g of GENERATED) expect(readFileSync(root + g.path, 'utf8'), g.path).toBe(g.render());
  });

  it('reads every C function the headers declare (ctypes argtypes come from them)', () => {
    for (const h of [...C_HEADERS.core, ...C_HEADERS.cuda]) {
      const text = readFileSync(root + h, 'utf8').replace(/\/\*[\s\S]*?\*\//g, '');
      const declared = [...text.matchAll(/\bTP_API\b/g)].length - (text.includes('#define TP_API') ? 2 : 0);
      expect(parseFunctions(text).length, h).toBe(declared);
    }
    const core = parseFunctions(readFileSync(root + 'native/core/mask.h', 'utf8')).find((f) => f.name === 'tp_mask_blocks')!;
    expect(core.returns).toBe('int');
    expect(core.params).toEqual([
      { type: 'int32_t*', name: 'subtree_end' },
      { type: 'int64_t', name: 'n' },
      { type: 'int32_t', name: 'block_size' },
      { type: 'int32_t*', name: 'kv_num' },
      { type: 'int32_t*', name: 'kv_idx' },
      { type: 'int32_t*', name: 'full_num' },
      { type: 'int32_t*', name: 'full_idx' },
    ]);
  });

  it('covers every config field and metric exactly once, and each addon was built from it', () => {
    const fields = [...LOSS_CONFIG_ENUMS.map((e) => e.name), ...LOSS_CONFIG_NUMBERS];
    expect([...fields].sort()).toEqual(Object.keys(DEFAULT_LOSS_CONFIG).sort());
    const { batch, lp } = randomLossCase([[1, 2, 3]], 1);
    expect([...LOSS_METRICS_FIELDS].sort()).toEqual(Object.keys(lossReference(batch, lp, resolveLossConfig({})).metrics).sort());
    const native = loadNative();
    if (!('error' in native)) expect(native.binding.abi()).toBe(ABI_HASH);
    const cuda = loadCuda();
    if (!('error' in cuda)) expect(cuda.binding.abi()).toBe(ABI_HASH);
  });

  it('configVector follows the table: enum codes, then numbers', () => {
    const cfg = resolveLossConfig({
      policy: 'cispo',
      aggregation: 'seq-mean-token-sum-norm',
      norm_constant: 5,
      kl: 'k3',
      kl_coef: 0.5,
      tis: 'sequence',
      tis_cap: 3,
    });
    expect(Array.from(configVector(cfg))).toEqual([2, 3, 4, 2, 0.2, 0.2, 0, 20, 5, 0, 0, 0.5, 3, 1]);
  });
});

const BASE: Partial<LossConfig> = { clip_low: 0.2, clip_high: 0.28, norm_constant: 7, kl: 'k2', kl_coef: 0.1, tis: 'token', tis_cap: 1.5 };

/** Per field, configs that differ from BASE in that field alone (every value of an enum). */
function variants(compact: boolean): [string, Partial<LossConfig>][] {
  const out: [string, Partial<LossConfig>][] = [];
  for (const e of LOSS_CONFIG_ENUMS) {
    for (const v of e.names) if (!(compact && v === 'gspo')) out.push([`${e.name}=${v}`, { ...BASE, [e.name]: v }]);
  }
  const numbers: Partial<Record<keyof LossConfig, [number, Partial<LossConfig>?]>> = {
    clip_low: [0.05],
    clip_high: [0.6],
    dual_clip: [1.3],
    log_ratio_clamp: [0.15],
    norm_constant: [3, { aggregation: 'seq-mean-token-sum-norm' }],
    global_tokens: [500],
    global_sequences: [40, { aggregation: 'seq-mean-token-sum' }],
    kl_coef: [0.9],
    tis_cap: [1.05],
    loss_scale: [2.5],
  };
  for (const n of LOSS_CONFIG_NUMBERS) {
    const [value, extra] = numbers[n]!;
    out.push([`${n} (base)`, { ...BASE, ...extra }]);
    out.push([`${n}=${value}`, { ...BASE, ...extra, [n]: value }]);
  }
  return out;
}

function differs(a: LossResult, b: LossResult): boolean {
  if (Math.abs(a.loss - b.loss) > 1e-4) return true;
  for (const k of LOSS_METRICS_FIELDS) if (Math.abs(a.metrics[k] - b.metrics[k]) > 1e-4) return true;
  return a.grad.some((g, p) => Math.abs(g - b.grad[p]) > 1e-4);
}

function expectEqual(got: LossResult, want: LossResult, tol: number, what: string): void {
  close(got.loss, want.loss, tol, `${what} loss`);
  for (const k of LOSS_METRICS_FIELDS) close(got.metrics[k], want.metrics[k], tol, `${what} ${k}`);
  want.grad.forEach((g, p) => close(got.grad[p], g, tol, `${what} grad[${p}]`));
}

/** Every variant equals js, and for each number field the value changes js's result (else the test proves nothing). */
function checkFields(
  list: [string, Partial<LossConfig>][],
  js: (c: LossConfig) => LossResult,
  run: (c: LossConfig) => Promise<LossResult>,
  tol: number,
) {
  return async () => {
    const results = new Map<string, LossResult>();
    for (const [name, config] of list) {
      const cfg = resolveLossConfig(config);
      const want = js(cfg);
      expectEqual(await run(cfg), want, tol, name);
      results.set(name, want);
    }
    for (const n of LOSS_CONFIG_NUMBERS) {
      const [base, changed] = [...results.entries()]
        .filter(([k]) => k.startsWith(`${n} (base)`) || k.startsWith(`${n}=`))
        .map(([, r]) => r);
      expect(differs(base, changed), `${n} changes the js result`).toBe(true);
    }
    for (const e of LOSS_CONFIG_ENUMS) {
      const rs = [...results.entries()].filter(([k]) => k.startsWith(`${e.name}=`)).map(([, r]) => r);
      for (let i = 1; i < rs.length; i++) expect(differs(rs[0], rs[i]), `${e.name} values give different js results`).toBe(true);
    }
  };
}

const lossCase = randomLossCase(randomBatch(3, { count: 24, alphabet: 3 }), 3, { maskRate: 0.2 });
for (let j = 0; j < lossCase.batch.advantages!.length; j++) lossCase.batch.advantages![j] = ((j * 7) % 5) - 2; // both signs, and 0
/** Every call also carries a per-sequence weight and turns (runs of 1 to 3 tokens), which the turn mode reads. */
function withTurnsAndWeights(batch: MicroBatch & { seq_weight?: Float32Array }): void {
  const off = batch.seq_offsets;
  batch.turn_ids = new Int32Array(off[off.length - 1]);
  batch.seq_weight = new Float32Array(off.length - 1);
  for (let i = 0; i + 1 < off.length; i++) {
    batch.seq_weight[i] = (i % 4) * 0.5;
    for (let j = off[i]; j < off[i + 1]; j++) batch.turn_ids[j] = Math.floor(((j - off[i]) * (1 + (i % 3))) / 4) - 1;
  }
}
withTurnsAndWeights(lossCase.batch);
const compactCase = randomLossCase(randomBatch(4, { count: 24, alphabet: 3 }), 4, { sharedOld: true, maskRate: 0.2 });
withTurnsAndWeights(compactCase.batch);
const tolerance = (b: BackendName) => (b === 'webgpu' ? 2e-5 : 1e-6);

await describeBackends('loss', (backend) => {
  it('every config field, each value, reaches the kernel', async () => {
    const { batch, lp } = lossCase;
    await checkFields(
      variants(false),
      (c) => lossReference(batch, lp, c),
      async (c) => computeLoss(batch, lp, c, { backend }),
      tolerance(backend),
    )();
  });
});

await describeBackends('lossCompact', (backend) => {
  it('every config field, each value, reaches the compact kernel', async () => {
    const { batch, lp } = compactCase;
    const run = async (c: LossConfig) => computeLossCompact(buildCompactPlan(batch, c), lp, c, { backend });
    await checkFields(variants(true), (c) => lossReference(batch, lp, c), run, tolerance(backend))();
  });
});

const pythonEnv = { ...process.env, PYTHONPATH: root + 'python', PYTHONDONTWRITEBYTECODE: '1' };
function python(request: object): Record<string, unknown> {
  const r = spawnSync('python3', [root + 'test/helpers/abi_probe.py'], {
    input: JSON.stringify(request),
    env: pythonEnv,
    encoding: 'utf8',
    maxBuffer: 64 << 20,
  });
  if (r.status !== 0) throw new Error(`abi_probe.py failed: ${r.stderr}`);
  return JSON.parse(r.stdout);
}
const probe = spawnSync('python3', ['-c', 'from treepack import loss; loss.core_library()'], { env: pythonEnv, encoding: 'utf8' });
const pySkip = probe.error
  ? `python3 not runnable (${probe.error.message})`
  : probe.status !== 0
    ? `python3 cannot load the C core through ctypes (${probe.stderr.trim().split('\n').pop()})`
    : '';
if (pySkip) console.log(`Python ctypes ABI tests skipped: ${pySkip}`);

describe.skipIf(pySkip !== '')(`Python ctypes${pySkip ? ` (skipped: ${pySkip})` : ''}`, () => {
  it('make_config fills the struct as configVector does, and refuses what resolveLossConfig refuses', () => {
    const good = [
      {},
      { policy: 'gspo', aggregation: 'seq-mean-token-mean', kl: 'k1', kl_coef: 2, tis: 'sequence' },
      { clip_low: 0.1, dual_clip: 2.5, global_tokens: 9 },
    ];
    const bad = [
      { policy: 'grpo' },
      { clip_low: -1 },
      { dual_clip: 1 },
      { dual_clip: 2, policy: 'cispo' },
      { log_ratio_clamp: 0 },
      { tis_cap: 0 },
      { global_tokens: -1 },
      { kl_coef: Infinity },
      { aggregation: 'seq-mean-token-sum-norm' },
      { clip_ratio: 0.2 },
    ];
    const res = python({ mode: 'config', configs: [...good, ...bad] }).results as { fields?: Record<string, number>; error?: string }[];
    good.forEach((c, i) => {
      const vec = configVector(resolveLossConfig(c));
      const names = [...LOSS_CONFIG_ENUMS.map((e) => e.name), ...LOSS_CONFIG_NUMBERS];
      expect(
        names.map((n) => res[i].fields![n]),
        JSON.stringify(c),
      ).toEqual(Array.from(vec));
    });
    bad.forEach((c, i) => {
      const err = caught(() => resolveLossConfig(c)) as TreepackError;
      expect(err, JSON.stringify(c)).toBeInstanceOf(TreepackError);
      expect(res[good.length + i].error, JSON.stringify(c)).toContain(err.where.field!);
    });
  });

  it('every config field, each value, reaches tp_loss through ctypes', () => {
    const { batch, lp } = lossCase;
    const list = variants(false);
    const arrays = Object.fromEntries(
      [
        'seq_offsets',
        'seq_positions',
        'loss_mask',
        'advantages',
        'old_logprobs',
        'ref_logprobs',
        'rollout_logprobs',
        'seq_weight',
        'turn_ids',
      ].map((k) => [k, Array.from(batch[k as keyof typeof batch] as ArrayLike<number>)]),
    );
    const res = python({ mode: 'loss', batch: arrays, lp: Array.from(lp), configs: list.map(([, c]) => c) }).results as {
      loss: number;
      grad: number[];
      metrics: LossResult['metrics'];
    }[];
    list.forEach(([name, config], i) => {
      const want = lossReference(batch, lp, resolveLossConfig(config));
      expectEqual({ loss: res[i].loss, grad: Float32Array.from(res[i].grad), metrics: res[i].metrics }, want, 1e-6, `python ${name}`);
    });
  });

  // One ctypes run answers both tests below: the CPU core's statuses, and the CUDA library's or why it is absent.
  const calls: [object, string, 'host' | 'device'][] = [
    [{}, 'TP_OK', 'device'],
    [{ null: ['off'] }, 'TP_ERR_ARG', 'host'],
    [{ null: ['pos'] }, 'TP_ERR_ARG', 'host'],
    [{ null: ['lp'] }, 'TP_ERR_ARG', 'host'],
    [{ null: ['ref'], config: { kl: 'k1' } }, 'TP_ERR_ARG', 'host'],
    [{ null: ['ref'] }, 'TP_OK', 'device'], // no KL: ref unused
    [{ null: ['roll'], config: { tis: 'token' } }, 'TP_ERR_ARG', 'host'],
    [{ codes: { policy: 3 } }, 'TP_ERR_ARG', 'host'],
    [{ codes: { aggregation: -1 } }, 'TP_ERR_ARG', 'host'],
    [{ codes: { kl: 5 } }, 'TP_ERR_ARG', 'host'],
    [{ codes: { tis: 3 } }, 'TP_ERR_ARG', 'host'],
    [{ set: { S: -1 } }, 'TP_ERR_ARG', 'host'],
    [{ set: { N: 2 ** 31 } }, 'TP_ERR_TOO_LARGE', 'host'],
    [{ set: { off: [1, 3, 5] } }, 'TP_ERR_OFFSETS', 'device'],
    [{ set: { M: 4 } }, 'TP_ERR_OFFSETS', 'device'],
    [{ set: { off: [0, 6, 5] } }, 'TP_ERR_OFFSETS', 'device'],
    [{ set: { pos: [0, 1, 2, 0, 4] } }, 'TP_ERR_INDEX', 'device'],
    [{ set: { pos: [0, -1, 2, 0, 3] } }, 'TP_ERR_INDEX', 'device'],
    [{ set: { off: [1, 3, 5], pos: [0, 1, 9, 0, 3] } }, 'TP_ERR_OFFSETS', 'device'],
    [{ null: ['turn'], config: { aggregation: 'seq-mean-turn-mean-token-mean' } }, 'TP_ERR_ARG', 'host'],
    [{ null: ['turn', 'sw'] }, 'TP_OK', 'device'], // not the turn mode: turn ids unused, no seq_weight = 1
    [{ config: { aggregation: 'seq-mean-turn-mean-token-mean' } }, 'TP_OK', 'device'],
    [{ set: { turn: [0, 1, 0, 0, 0] }, config: { aggregation: 'seq-mean-turn-mean-token-mean' } }, 'TP_ERR_TURNS', 'device'],
    [{ set: { turn: [0, 1, 0, 0, 0] } }, 'TP_OK', 'device'], // only the turn mode reads them
    [
      { set: { pos: [0, 1, 2, 0, 9], turn: [0, 1, 0, 0, 0] }, config: { aggregation: 'seq-mean-turn-mean-token-mean' } },
      'TP_ERR_INDEX',
      'device',
    ],
  ];
  let answers: Record<string, unknown> | undefined;
  const statusAnswers = () => (answers ??= python({ mode: 'status', calls: calls.map(([c]) => c) }));

  it('tp_loss answers bad arguments with the status each one calls for', () => {
    expect((statusAnswers().core as number[]).map((s) => STATUSES[s].name)).toEqual(calls.map(([, want]) => want));
  });

  it('tp_cuda_loss_host answers the same bad arguments with the same status', (ctx) => {
    const res = statusAnswers();
    if (typeof res.cuda === 'string') return ctx.skip(`CUDA C ABI not loaded: ${res.cuda}`);
    const gpu = cudaDeviceInfo().available;
    if (!gpu) console.log('CUDA C ABI: checks made before the device checked here; device-side checks await a GPU');
    calls.forEach(([call, want, where], i) => {
      const got = STATUSES[(res.cuda as number[])[i]].name;
      // Without a device, what is checked on the device fails first on the device itself: TP_ERR_DEVICE.
      expect(got, JSON.stringify(call)).toBe(where === 'host' || gpu ? want : 'TP_ERR_DEVICE');
    });
    if (!gpu) expect(res.cuda_last_error).toBe(35);
  });
});

describe('the addons answer bad arguments alike', () => {
  const addons: [string, Addon][] = [];
  const native = loadNative();
  if (!('error' in native)) addons.push(['cpu', native.binding]);
  const cuda = loadCuda();
  if (!('error' in cuda)) addons.push(['cuda', cuda.binding]);
  const gpu = cudaDeviceInfo().available;

  it.skipIf(addons.length === 0)('a tree out of range is E_INPUT "not a packed forest" on every addon (checked on the host)', () => {
    const parent = Int32Array.from([-1, 0, 5]);
    const se = Int32Array.from([3, 3, 3]);
    const badEnd = Int32Array.from([3, 9, 3]);
    for (const [name, b] of addons) {
      for (const [what, call] of [
        ['maskDense', () => b.maskDense(parent, se)],
        ['maskBits', () => b.maskBits(parent, se)],
        ['maskBlocks', () => b.maskBlocks(badEnd, 2)],
      ] as const) {
        const err = caught(call) as TreepackError;
        expect(err, `${name} ${what}`).toBeInstanceOf(TreepackError);
        expect(err.code, `${name} ${what}`).toBe('E_INPUT');
        expect(err.message, `${name} ${what}`).toMatch(/not a packed forest/);
      }
    }
  });

  it.skipIf(addons.length === 0)(
    'the loss refuses a config code out of range (E_ARG) and, where it runs, a position out of range (E_INPUT)',
    () => {
      const { batch, lp } = randomLossCase(
        [
          [1, 2, 3],
          [1, 4],
        ],
        2,
        { maskRate: 0 },
      );
      const args = (config: Float64Array, pos = batch.seq_positions) => [
        config,
        batch.seq_offsets,
        pos,
        batch.loss_mask,
        batch.advantages,
        batch.old_logprobs,
        null,
        null,
        null,
        null,
        lp,
        new Float32Array(lp.length),
      ];
      const badCode = configVector(resolveLossConfig({}));
      badCode[0] = 7;
      const badPos = batch.seq_positions.slice();
      badPos[2] = lp.length;
      for (const [name, b] of addons) {
        const err = caught(() => b.loss(...args(badCode))) as TreepackError;
        expect(err.code, name).toBe('E_ARG');
        expect(err.message, name).toMatch(/invalid argument/);
        if (name === 'cuda' && !gpu) continue; // positions are checked on the device
        const pe = caught(() => b.loss(...args(configVector(resolveLossConfig({})), badPos))) as TreepackError;
        expect(pe.code, name).toBe('E_INPUT');
        expect(pe.message, name).toMatch(/seq_positions holds a position outside/);
      }
    },
  );
});
