/**
 * The RL loss on every backend: the float64 fixture test/fixtures/loss_reference.json (verl semantics) to 1e-6,
 * random packed batches against an independent float64 reference on the unpacked batch, gradients against finite
 * differences, every backend equal to js, packing invariance, the compact per-node mode, and bad input.
 */
import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { computeLoss, computeLossCompact, type BackendName } from '../src/backend/index.js';
import { cudaDeviceInfo } from '../src/backend/native.js';
import { TreepackError } from '../src/errors.js';
import {
  buildCompactPlan,
  episodeAdvantages,
  resolveLossConfig,
  type LossBatch,
  type LossConfig,
  type LossMetrics,
} from '../src/loss/index.js';
import { lossReference } from '../src/loss/reference.js';
import { FORMAT, type MicroBatch } from '../src/pack/contract.js';
import { packForest } from '../src/pack/forest.js';
import { describeBackends } from './helpers/backends.js';
import { caught } from './helpers/errors.js';
import { close, LOSS_CONFIGS as CONFIGS, randomLossCase, unpackedLoss } from './helpers/loss.js';
import { csr, randomBatch, rng } from './helpers/sequences.js';

if (!cudaDeviceInfo().available) console.log('CUDA loss kernel: compiled only here, runtime tests await a GPU host');
// float32 end to end (WGSL has no f64) against a float64 oracle.
const tolerance = (b: BackendName) => (b === 'webgpu' ? 2e-5 : 1e-6);

const fx = JSON.parse(readFileSync(new URL('./fixtures/loss_reference.json', import.meta.url), 'utf8'));

/** The fixture's sequences packed with a shared root token (t = 0, never trainable), one node per other token. */
function fixtureBatch(): { batch: MicroBatch; lp: Float32Array } {
  const seqs: number[][] = [];
  let tok = 1;
  for (const s of fx.sequences) seqs.push([0, ...s.logprobs.map(() => tok++)]);
  const c = csr(seqs);
  const forest = packForest(c);
  const M = c.tokens.length;
  const f = {
    loss_mask: new Uint8Array(M),
    advantages: new Float32Array(M),
    old_logprobs: new Float32Array(M),
    ref_logprobs: new Float32Array(M),
    rollout_logprobs: new Float32Array(M),
  };
  const lp = new Float32Array(forest.input_ids.length);
  fx.sequences.forEach((s: Record<string, number[] | number>, i: number) => {
    (s.logprobs as number[]).forEach((_, k) => {
      const j = c.offsets[i] + k + 1;
      f.loss_mask[j] = 1;
      f.advantages[j] = s.advantage as number;
      f.old_logprobs[j] = (s.old_logprobs as number[])[k];
      f.ref_logprobs[j] = (s.ref_logprobs as number[])[k];
      f.rollout_logprobs[j] = (s.rollout_logprobs as number[])[k];
      lp[forest.seq_positions[j]] = (s.logprobs as number[])[k];
    });
  });
  const meta = {
    format: FORMAT,
    num_sequences: seqs.length,
    num_tokens_naive: M,
    num_tokens_packed: forest.input_ids.length,
    tokenizer: 't',
    sequence_ids: ['a', 'b'],
  } as const;
  return { batch: { ...forest, ...f, meta: { ...meta, sequence_ids: [...meta.sequence_ids] } }, lp };
}
const base = () => ({ clip_low: fx.params.clip_low, clip_high: fx.params.clip_high, log_ratio_clamp: fx.params.log_ratio_clamp });
const vanilla = () => ({ ...base(), dual_clip: fx.params.dual_clip_c });

describe('the fixture loss_reference.json', () => {
  it('GRPO advantages (unbiased std, ε)', () => {
    const a = episodeAdvantages(
      fx.group_rewards,
      fx.group_rewards.map(() => 'g'),
      { estimator: 'grpo', epsilon: fx.grpo.eps },
    );
    a.forEach((x, i) => close(x, fx.grpo.advantages[i], 1e-6, `advantage ${i}`));
  });
});

function expectMatchesReference(
  got: { loss: number; metrics: LossMetrics },
  want: ReturnType<typeof unpackedLoss>,
  tol: number,
  what: string,
) {
  close(got.loss, want.loss, tol, `${what} loss`);
  close(got.metrics.pg_loss, want.pg_loss, tol, `${what} pg_loss`);
  close(got.metrics.kl_loss, want.kl_loss, tol, `${what} kl_loss`);
  close(got.metrics.clipfrac_high + got.metrics.clipfrac_low, want.clipfrac, tol, `${what} clipfrac`);
  close(got.metrics.clipfrac_dual, want.clipfrac_dual, tol, `${what} dual clipfrac`);
  close(got.metrics.approx_kl, want.approx_kl, tol, `${what} approx_kl`);
  close(got.metrics.ratio_min, want.ratio_min, tol, `${what} ratio_min`);
  close(got.metrics.ratio_max, want.ratio_max, tol, `${what} ratio_max`);
  close(got.metrics.ratio_mean, want.ratio_mean, tol, `${what} ratio_mean`);
  expect(got.metrics.trainable_tokens).toBe(want.trainable_tokens);
}

describe('random packed batches', () => {
  it('js gradient equals central finite differences of the loss (float64)', () => {
    for (const seed of [3, 5, 8]) {
      const { batch, lp } = randomLossCase(randomBatch(seed + 1, { maxLen: 10 }), seed, { maskRate: 0.2 });
      for (const [k, config] of CONFIGS.entries()) {
        const cfg = resolveLossConfig(config);
        // CISPO's gradient is by definition that of the surrogate with its weight detached, not of the loss value.
        if (cfg.policy === 'cispo') continue;
        if (cfg.policy === 'gspo') {
          // verl's GSPO gradient (lp − sg(lp) + sg(mean log ratio) per token) is the derivative of the loss only
          // when the advantage is constant along a sequence, as it is in practice: make it so here.
          for (let i = 0; i + 1 < batch.seq_offsets.length; i++)
            batch.advantages!.fill(batch.advantages![batch.seq_offsets[i]], batch.seq_offsets[i], batch.seq_offsets[i + 1]);
        }
        // lossReference is plain arithmetic on whatever array it gets: a Float64Array lp makes float64 differences possible.
        const lp64 = Float64Array.from(lp) as unknown as Float32Array;
        const g = lossReference(batch, lp64, cfg).grad;
        const h = 1e-6;
        for (let p = 0; p < lp.length; p++) {
          const x = lp64[p];
          lp64[p] = x + h;
          const up = lossReference(batch, lp64, cfg).loss;
          lp64[p] = x - h;
          const down = lossReference(batch, lp64, cfg).loss;
          lp64[p] = x;
          close(g[p], (up - down) / (2 * h), 2e-5, `seed ${seed} config ${k} d/dlp[${p}]`);
        }
      }
    }
  });
});

describe('compact per-node mode', () => {
  it('refuses batches whose occurrences disagree on old_logprobs, and gspo', () => {
    const { batch } = randomLossCase(
      [
        [1, 2, 3],
        [1, 2, 4],
      ],
      1,
      { maskRate: 0 },
    );
    batch.old_logprobs![1] = -0.5;
    batch.old_logprobs![4] = -0.25;
    const err = caught(() => buildCompactPlan(batch)) as TreepackError;
    expect(err.where.field).toBe('old_logprobs');
    expect((caught(() => buildCompactPlan(batch, { policy: 'gspo' })) as TreepackError).where.field).toBe('policy');
  });
});

await describeBackends('loss', (backend) => {
  it('every expected number of the fixture loss_reference.json', async () => {
    const { batch, lp } = fixtureBatch();
    const tol = 1e-6;
    const e = fx.expected;
    for (const [agg, want] of Object.entries(e.loss) as [LossConfig['aggregation'], number][]) {
      const r = await computeLoss(batch, lp, { ...vanilla(), aggregation: agg, norm_constant: 3 }, { backend });
      close(r.loss, want, tol, `${agg} loss`);
    }
    const r = await computeLoss(batch, lp, vanilla(), { backend });
    close(r.metrics.clipfrac_high + r.metrics.clipfrac_low, e.pg_clipfrac, tol, 'pg_clipfrac');
    close(r.metrics.clipfrac_dual, e.pg_clipfrac_lower, tol, 'pg_clipfrac_lower');
    close(r.metrics.approx_kl, e.ppo_kl_token_mean, tol, 'ppo_kl');
    close(r.metrics.ratio_min, Math.min(...e.ratio), tol, 'ratio min');
    close(r.metrics.ratio_max, Math.max(...e.ratio), tol, 'ratio max');
    close(r.metrics.ratio_mean, e.ratio.reduce((a: number, b: number) => a + b, 0) / e.ratio.length, tol, 'ratio mean');
    expect(r.metrics.trainable_tokens).toBe(5);
    const k3 = await computeLoss(batch, lp, { ...vanilla(), kl: 'k3', kl_coef: 0.5 }, { backend });
    close(k3.metrics.kl_loss, e.k3_token_mean, tol, 'k3 token-mean');
    close(k3.loss, e.loss['token-mean'] + 0.5 * e.k3_token_mean, tol, 'pg + 0.5·k3');
    const gspo = await computeLoss(batch, lp, { ...base(), policy: 'gspo', aggregation: 'seq-mean-token-mean' }, { backend });
    close(gspo.loss, e.gspo_loss, tol, 'gspo');
    close(gspo.metrics.ratio_max, Math.max(...e.gspo_seq_ratio), tol, 'gspo seq ratio');
    const cispo = await computeLoss(batch, lp, { ...base(), policy: 'cispo' }, { backend });
    close(cispo.loss, e.cispo_token_mean, tol, 'cispo');
    const tis = await computeLoss(batch, lp, { ...vanilla(), tis: 'token', tis_cap: fx.params.tis_cap }, { backend });
    close(tis.loss, e.tis_vanilla_token_mean, tol, 'tis');
  });

  const cases = Array.from({ length: 12 }, (_, seed) => seed);
  it('equals the float64 unpacked reference on random packed batches (odd seeds: with seq_weight and loss_scale)', async () => {
    for (const seed of cases) {
      const { batch, lp, unpacked } = randomLossCase(randomBatch(seed + 1), seed);
      if (seed % 2) {
        const weights = unpacked.map((u, i) => (u.weight = [0, 1, 0.25, 3][i % 4]));
        (batch as LossBatch).seq_weight = Float32Array.from(weights);
      }
      for (const [k, config] of CONFIGS.entries()) {
        const cfg = resolveLossConfig(seed % 2 ? { ...config, loss_scale: 4 } : config);
        const got = await computeLoss(batch, lp, cfg, { backend });
        expectMatchesReference(got, unpackedLoss(unpacked, cfg), tolerance(backend), `seed ${seed} config ${k}`);
        if (backend !== 'js') {
          const js = lossReference(batch, lp, cfg);
          for (let p = 0; p < lp.length; p++) close(got.grad[p], js.grad[p], tolerance(backend), `seed ${seed} config ${k} grad[${p}]`);
        }
      }
    }
  });

  it('packing invariance: same loss and per-occurrence gradients with and without shared prefixes', async () => {
    for (const seed of [1, 2, 9]) {
      const seqs = randomBatch(seed, { count: 30 });
      const shared = randomLossCase(seqs, seed, { layout: 'trie' });
      const flat = randomLossCase(seqs, seed, { layout: 'chains' });
      expect(shared.batch.input_ids.length).toBeLessThan(flat.batch.input_ids.length);
      for (const config of CONFIGS) {
        const a = await computeLoss(shared.batch, shared.lp, config, { backend });
        const b = await computeLoss(flat.batch, flat.lp, config, { backend });
        close(a.loss, b.loss, tolerance(backend), `${backend} loss`);
        // In the chain layout node = occurrence: summing its gradient over each shared node gives the packed one.
        const summed = new Float64Array(a.grad.length);
        flat.batch.seq_positions.forEach((_, j) => (summed[shared.batch.seq_positions[j]] += b.grad[j]));
        summed.forEach((g, p) => close(a.grad[p], g, tolerance(backend), `${backend} grad[${p}]`));
      }
    }
  });

  it('adversarial shapes on every backend: empty, one token, duplicates, prefixes, deep, wide, 130k tokens', async () => {
    const r = rng(4);
    const long = Array.from({ length: 130_000 }, () => Math.floor(r() * 50));
    const shapes: [string, number[][]][] = [
      ['empty batch', []],
      ['empty sequences', [[], []]],
      ['one token', [[7]]],
      [
        'duplicates',
        [
          [1, 2, 3],
          [1, 2, 3],
          [1, 2, 3],
        ],
      ],
      ['prefix of another', [[1, 2], [1, 2, 3, 4], [1]]],
      ['deep', [long.slice(0, 5000), long.slice(0, 3000)]],
      ['wide', Array.from({ length: 300 }, (_, i) => [0, 1, i % 150, i])],
      ['long', [long, long.slice(0, 100_000).concat([1, 2, 3])]],
    ];
    for (const [name, seqs] of shapes) {
      const { batch, lp, unpacked } = randomLossCase(seqs, 11);
      for (const config of [CONFIGS[1], CONFIGS[4], CONFIGS[5]]) {
        const cfg = resolveLossConfig(config);
        const got = await computeLoss(batch, lp, cfg, { backend });
        expectMatchesReference(
          got,
          unpackedLoss(unpacked, cfg),
          name === 'long' && backend === 'webgpu' ? 1e-4 : tolerance(backend),
          `${name} on ${backend}`,
        );
      }
    }
  });

  it('all-masked gives 0, and masked positions never leak NaN or inf', async () => {
    const { batch, lp } = randomLossCase(randomBatch(6), 6);
    batch.loss_mask.fill(0);
    lp.fill(NaN);
    batch.advantages!.fill(Infinity);
    batch.old_logprobs!.fill(NaN);
    for (const config of CONFIGS) {
      const res = await computeLoss(batch, lp, config, { backend });
      expect(res.loss, backend).toBe(0);
      expect(
        res.grad.every((g) => g === 0),
        backend,
      ).toBe(true);
      expect(
        Object.values(res.metrics).every((v) => v === 0),
        backend,
      ).toBe(true);
    }
    const part = randomLossCase(randomBatch(7), 7);
    const clean = await computeLoss(part.batch, part.lp, CONFIGS[2], { backend: 'js' });
    part.batch.loss_mask.forEach((m, j) => {
      if (!m) part.batch.old_logprobs![j] = NaN;
    });
    const dirty = lossReference(part.batch, part.lp, resolveLossConfig(CONFIGS[2]));
    expect(Number.isFinite(dirty.loss)).toBe(true);
    close(dirty.loss, clean.loss, 1e-5, 'masked NaN changes nothing');
  });
});

await describeBackends('lossCompact', (backend) => {
  it('equals the per-occurrence mode when occurrences share old and ref', async () => {
    for (const seed of [1, 2, 3, 4, 5]) {
      const { batch, lp } = randomLossCase(randomBatch(seed, { count: 40 }), seed, { sharedOld: true });
      for (const config of CONFIGS.filter((c) => c.policy !== 'gspo')) {
        const plan = buildCompactPlan(batch, config);
        const a = await computeLossCompact(plan, lp, config, { backend });
        const b = lossReference(batch, lp, resolveLossConfig(config));
        const tol = tolerance(backend);
        close(a.loss, b.loss, tol, 'loss');
        for (const key of Object.keys(b.metrics) as (keyof typeof b.metrics)[]) close(a.metrics[key], b.metrics[key], tol, key);
        a.grad.forEach((g, p) => close(g, b.grad[p], tol, `grad[${p}]`));
        if (backend !== 'js') {
          // and equal to the same backend's per-occurrence mode
          const c = await computeLoss(batch, lp, config, { backend });
          close(a.loss, c.loss, tol, 'loss vs per-occurrence');
          a.grad.forEach((g, p) => close(g, c.grad[p], tol, `grad[${p}] vs per-occurrence`));
        }
      }
    }
  });
});

describe('bad input', () => {
  const { batch, lp } = randomLossCase(
    [
      [1, 2, 3],
      [1, 4],
    ],
    1,
    { maskRate: 0 },
  );
  const field = async (f: () => unknown) => {
    const err = await (async () => f())().then(
      () => undefined,
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(TreepackError);
    return (err as TreepackError).where.field;
  };
  it('names the field', async () => {
    expect(await field(() => computeLoss(batch, lp.subarray(1)))).toBe('logprobs');
    expect(await field(() => computeLoss(batch, Array.from(lp) as unknown as Float32Array))).toBe('logprobs');
    const nan = lp.slice();
    nan[batch.seq_positions[1]] = NaN;
    expect(await field(() => computeLoss(batch, nan))).toBe('logprobs');
    const badAdv = { ...batch, advantages: batch.advantages!.slice() };
    badAdv.advantages[2] = NaN;
    expect(await field(() => computeLoss(badAdv, lp))).toBe('advantages');
    expect(await field(() => computeLoss({ ...batch, ref_logprobs: undefined }, lp, { kl: 'k3', kl_coef: 1 }))).toBe('ref_logprobs');
    expect(await field(() => computeLoss({ ...batch, rollout_logprobs: new Float32Array(2) }, lp, { tis: 'token' }))).toBe(
      'rollout_logprobs',
    );
    expect(await field(() => resolveLossConfig({ policy: 'grpo' as never }))).toBe('policy');
    expect(await field(() => resolveLossConfig({ aggregation: 'mean' as never }))).toBe('aggregation');
    expect(await field(() => resolveLossConfig({ kl: 'k4' as never }))).toBe('kl');
    expect(await field(() => resolveLossConfig({ clip_low: -0.1 }))).toBe('clip_low');
    expect(await field(() => resolveLossConfig({ clip_high: -1 }))).toBe('clip_high');
    expect(await field(() => resolveLossConfig({ dual_clip: 1 }))).toBe('dual_clip');
    expect(await field(() => resolveLossConfig({ dual_clip: 0.5 }))).toBe('dual_clip');
    expect(await field(() => resolveLossConfig({ clip_ratio: 0.2 }))).toBe('clip_ratio');
    expect(await field(() => resolveLossConfig({ aggregation: 'seq-mean-token-sum-norm' }))).toBe('norm_constant');
    expect(String(caught(() => resolveLossConfig({ dual_clip: 1 })))).toMatch(
      /Expected a number > 1 .* for dual_clip but received 1 of type number/,
    );
  });
});

describe('advantages', () => {
  it('GRPO, Dr.GRPO, RLOO and the REINFORCE++ baseline against hand-computed values', () => {
    const rewards = [1, 0, 0, 1, 0.5, 2];
    const groups = ['a', 'a', 'a', 'a', 'b', 'c'];
    const grpo = episodeAdvantages(rewards, groups, { estimator: 'grpo' });
    // group a: mean 0.5, unbiased std sqrt(1/3); groups of one: mean 0, std 1
    close(grpo[0], 0.5 / (Math.sqrt(1 / 3) + 1e-6), 1e-12, 'grpo');
    close(grpo[4], 0.5 / (1 + 1e-6), 1e-12, 'grpo singleton');
    const dr = episodeAdvantages(rewards, groups, { estimator: 'dr-grpo' });
    expect(Array.from(dr.slice(0, 4))).toEqual([0.5, -0.5, -0.5, 0.5]);
    const rloo = episodeAdvantages(rewards, groups, { estimator: 'rloo' });
    close(rloo[0], 1 - 1 / 3, 1e-12, 'rloo'); // 1 − mean(0, 0, 1)
    close(rloo[1], 0 - 2 / 3, 1e-12, 'rloo');
    const rpp = episodeAdvantages(rewards, groups, { estimator: 'reinforce++-baseline' }, [1, 1, 1, 1, 1, 1]);
    const mean = rpp.reduce((a, b) => a + b, 0) / 6;
    close(mean, 0, 1e-12, 'whitened mean');
    close(rpp.reduce((a, b) => a + b * b, 0) / 5, 1, 1e-6, 'whitened unbiased variance');
  });
});
