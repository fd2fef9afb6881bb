/**
 * The WebGPU loss beyond the parity suite of loss.test.ts: the chunk layout checked by hand, every chunk boundary
 * crossed on small inputs (`chunkBytes` lowers the bytes per binding: a node's occurrences and a sequence split
 * across chunks), determinism run to run, the compact mode chunked, and one batch whose trainable occurrences exceed
 * the adapter's real binding limit. The chunk size is passed per call, never through the process environment, so a
 * test still running past its time budget cannot change another test's layout.
 */
import { afterEach, describe, expect, it } from 'vitest';
import { computeLoss } from '../src/backend/index.js';
import { CHUNK_BYTES_ENV, lossCompactWebGPU, lossWebGPU } from '../src/backend/webgpu/loss.js';
import { chunkIndex, OCC_BYTES, occStream, planOccChunks, seqChunks } from '../src/backend/webgpu/loss-layout.js';
import { TreepackError } from '../src/errors.js';
import { buildCompactPlan, resolveLossConfig, type LossConfig, type LossResult } from '../src/loss/index.js';
import { lossReference } from '../src/loss/reference.js';
import type { CompactPlan, LossBatch } from '../src/loss/types.js';
import { validateCompactInputs, validateLossInputs } from '../src/loss/validate.js';
import { describeBackends } from './helpers/backends.js';
import { close, LOSS_CONFIGS, randomLossCase, unpackedLoss } from './helpers/loss.js';
import { randomBatch, rng } from './helpers/sequences.js';

afterEach(() => {
  delete process.env[CHUNK_BYTES_ENV];
});

/** computeLoss on webgpu with an explicit chunk size (validated as computeLoss does). */
async function gpu(b: LossBatch, lp: Float32Array, config: Partial<LossConfig>, chunkBytes?: number): Promise<LossResult> {
  const cfg = resolveLossConfig(config);
  validateLossInputs(b, lp, cfg);
  return lossWebGPU(b, lp, cfg, { chunkBytes });
}

async function gpuCompact(plan: CompactPlan, lp: Float32Array, config: Partial<LossConfig>, chunkBytes?: number): Promise<LossResult> {
  validateCompactInputs(plan, lp);
  return lossCompactWebGPU(plan, lp, resolveLossConfig(config), { chunkBytes });
}

const TOL = 2e-5; // f32 end to end against a float64 oracle, as in loss.test.ts

function expectEqualsJs(got: LossResult, want: LossResult, tol: number, what: string): void {
  close(got.loss, want.loss, tol, `${what} loss`);
  for (const key of Object.keys(want.metrics) as (keyof LossResult['metrics'])[])
    close(got.metrics[key], want.metrics[key], tol, `${what} ${key}`);
  for (let p = 0; p < want.grad.length; p++) close(got.grad[p], want.grad[p], tol, `${what} grad[${p}]`);
}

/** Node-sorted occurrence stream offsets from per-node counts. */
const offsets = (counts: number[]) => Uint32Array.from([0, ...counts.map((_, i) => counts.slice(0, i + 1).reduce((a, b) => a + b, 0))]);

describe('chunk layout', () => {
  it('cuts the node-sorted stream by occurrences mid-node and by nodes at node boundaries', () => {
    // nodes 0..6 hold 0, 5, 1, 0, 0, 2, 3 trainable occurrences
    const nodeOff = offsets([0, 5, 1, 0, 0, 2, 3]);
    expect(planOccChunks(nodeOff, 2, 3)).toEqual([
      { n0: 1, n1: 1, o0: 0, o1: 2 },
      { n0: 1, n1: 1, o0: 2, o1: 4 },
      { n0: 1, n1: 2, o0: 4, o1: 6 }, // node 1 ends here after three chunks; node 2 fits
      { n0: 5, n1: 5, o0: 6, o1: 8 }, // nodes 3 and 4 have none: skipped
      { n0: 6, n1: 6, o0: 8, o1: 10 },
      { n0: 6, n1: 6, o0: 10, o1: 11 },
    ]);
    expect(planOccChunks(offsets([1, 1, 1, 1, 1]), 100, 2)).toEqual([
      { n0: 0, n1: 1, o0: 0, o1: 2 },
      { n0: 2, n1: 3, o0: 2, o1: 4 },
      { n0: 4, n1: 4, o0: 4, o1: 5 },
    ]);
    expect(planOccChunks(offsets([0, 0]), 4, 4)).toEqual([]);
  });

  it('indexes a chunk: local node offsets clipped to its occurrences, then whole nodes per thread', () => {
    const nodeOff = offsets([0, 5, 1, 0, 0, 2, 3]);
    // chunk {nodes 1..2, occurrences 4..6}: node 1 keeps its last occurrence, node 2 its one
    expect(Array.from(chunkIndex(nodeOff, { n0: 1, n1: 2, o0: 4, o1: 6 }, 32).index)).toEqual([0, 1, 2, 0, 2]);
    // 100 nodes of 20 occurrences: a thread closes once it holds ≥ 32, i.e. every 2 nodes
    const wide = offsets(Array.from({ length: 100 }, () => 20));
    const { index, threads } = chunkIndex(wide, { n0: 0, n1: 99, o0: 0, o1: 2000 }, 32);
    expect(threads).toBe(50);
    expect(Array.from(index.subarray(101, 104))).toEqual([0, 2, 4]);
    expect(index[index.length - 1]).toBe(100);
    // 200 nodes with no occurrences: at most 64 nodes per thread at 64 per thread
    expect(chunkIndex(offsets([1, ...Array.from({ length: 199 }, () => 0)]), { n0: 0, n1: 199, o0: 0, o1: 1 }, 64).threads).toBe(4);
  });

  it('cuts the sequence stream with a sequence split across chunks', () => {
    // sequence 0: 5 tokens, 3 trainable (1, 2, 4); sequence 1: no trainable token; sequence 2: 2 trainable
    const b: LossBatch = {
      input_ids: new Int32Array(10),
      seq_offsets: Int32Array.from([0, 5, 7, 10]),
      seq_positions: Int32Array.from([0, 1, 2, 3, 4, 0, 5, 0, 6, 7]),
      loss_mask: Uint8Array.from([0, 1, 1, 0, 1, 0, 0, 0, 1, 1]),
      advantages: new Float32Array(10),
      old_logprobs: Float32Array.from([0, -1, -2, 0, -4, 0, 0, 0, -8, -9]),
    };
    const s = occStream(b, resolveLossConfig({ policy: 'gspo' }));
    expect(Array.from(s.seqIndex)).toEqual([0, 2]);
    const chunks = seqChunks(b, s, 2);
    expect(chunks.map((c) => [c.r0, c.o0, c.o1, c.firstTotal, c.lastOpen, Array.from(c.range)])).toEqual([
      [0, 0, 2, 0, true, [0, 2]],
      [0, 2, 4, 3, true, [0, 1, 2]], // sequence 0 ends here (its mean needs its total, 3); sequence 2 starts
      [1, 4, 5, 2, false, [0, 1]], // and ends here
    ]);
    const nodes = chunks.map((c) => Array.from(new Uint32Array(c.pairs.buffer)).filter((_, k) => k % 2 === 0));
    expect(nodes).toEqual([[1, 2], [4, 6], [7]]);
    expect(chunks.map((c) => Array.from(c.pairs).filter((_, k) => k % 2 === 1))).toEqual([[-1, -2], [-4, -8], [-9]]);
  });
});

await describeBackends(
  'loss',
  () =>
    describe('webgpu loss in chunks', () => {
      /** Checks that this batch really gets a node and a sequence cut between chunks of this size. */
      function chunked(bytes: number, b: LossBatch, cfg: LossConfig): void {
        const s = occStream(b, cfg);
        const chunks = planOccChunks(s.nodeOff, Math.floor(bytes / OCC_BYTES), Math.floor(bytes / 8) - 1);
        expect(
          chunks.some((c) => c.o0 > s.nodeOff[c.n0]),
          'a node split across chunks',
        ).toBe(true);
        if (cfg.policy === 'gspo')
          expect(
            seqChunks(b, s, Math.floor(bytes / 8)).some((c) => c.firstTotal > 0),
            'a sequence split across chunks',
          ).toBe(true);
      }

      it(
        'random batches, every config, 64- and 512-byte chunks: equal to js and to the unpacked reference',
        { timeout: 120_000 },
        async () => {
          for (const seed of [1, 2, 3, 4]) {
            // many duplicates: nodes with many occurrences
            const { batch, lp, unpacked } = randomLossCase(randomBatch(seed, { count: 60, alphabet: 2 }), seed);
            for (const [k, config] of LOSS_CONFIGS.entries()) {
              const cfg = resolveLossConfig(config);
              const js = lossReference(batch, lp, cfg);
              for (const bytes of [64, 512]) {
                chunked(bytes, batch, cfg);
                const got = await gpu(batch, lp, cfg, bytes);
                expectEqualsJs(got, js, TOL, `seed ${seed} config ${k} chunk ${bytes}`);
                const want = unpackedLoss(unpacked, cfg);
                close(got.loss, want.loss, TOL, `seed ${seed} config ${k} chunk ${bytes} vs unpacked`);
              }
            }
          }
        },
      );

      it(
        'adversarial shapes in chunks: one token, a node shared by 300 sequences, a 20k-token gspo sequence',
        { timeout: 120_000 },
        async () => {
          const r = rng(9);
          const long = Array.from({ length: 20_000 }, () => Math.floor(r() * 50));
          const shapes: [string, number[][], number][] = [
            ['one token', [[7, 8]], 64],
            ['wide', Array.from({ length: 300 }, (_, i) => [0, 1, i % 150, i]), 64],
            ['long', [long, long.slice(0, 15_000).concat([1, 2, 3])], 4096],
          ];
          for (const [name, seqs, bytes] of shapes) {
            const { batch, lp } = randomLossCase(seqs, 11, { maskRate: 0.1 });
            for (const config of [LOSS_CONFIGS[1], LOSS_CONFIGS[4], LOSS_CONFIGS[5]]) {
              const cfg = resolveLossConfig(config);
              if (name !== 'one token') chunked(bytes, batch, cfg);
              const got = await gpu(batch, lp, cfg, bytes);
              expectEqualsJs(got, lossReference(batch, lp, cfg), name === 'long' ? 1e-4 : TOL, `${name} ${cfg.policy}`);
            }
          }
        },
      );

      it(
        'the turn mode and seq_weight in 64-byte chunks equal js; a new seq_weight on the same batch is not served a stale layout',
        { timeout: 60_000 },
        async () => {
          const { batch, lp } = randomLossCase(randomBatch(6, { count: 40, alphabet: 2 }), 6);
          const off = batch.seq_offsets;
          batch.turn_ids = Int32Array.from(batch.seq_positions, (_, j) => {
            let i = 0;
            while (off[i + 1] <= j) i++;
            return Math.floor((j - off[i]) / (2 + (i % 3)));
          });
          const weighted = batch as LossBatch;
          for (const config of [
            { aggregation: 'seq-mean-turn-mean-token-mean' as const, kl: 'k3' as const, kl_coef: 0.1, loss_scale: 3 },
            LOSS_CONFIGS[2],
          ]) {
            const cfg = resolveLossConfig(config);
            chunked(64, batch, cfg);
            weighted.seq_weight = Float32Array.from({ length: off.length - 1 }, (_, i) => [0, 1, 0.5][i % 3]);
            expectEqualsJs(await gpu(weighted, lp, cfg, 64), lossReference(weighted, lp, cfg), TOL, `${cfg.aggregation} weighted`);
            weighted.seq_weight = Float32Array.from({ length: off.length - 1 }, (_, i) => [2, 0, 1][i % 3]);
            expectEqualsJs(await gpu(weighted, lp, cfg, 64), lossReference(weighted, lp, cfg), TOL, `${cfg.aggregation} reweighted`);
          }
        },
      );

      it('is bit-identical run to run, with a fresh layout too', { timeout: 60_000 }, async () => {
        const { batch, lp } = randomLossCase(randomBatch(5, { count: 50, alphabet: 3 }), 5);
        for (const config of [LOSS_CONFIGS[2], LOSS_CONFIGS[4]]) {
          const a = await gpu(batch, lp, config, 128);
          const b = await gpu(batch, lp, config, 128);
          const c = await gpu({ ...batch }, lp, config, 128); // a new object: prepared again
          for (const other of [b, c]) {
            expect(Buffer.from(other.grad.buffer).equals(Buffer.from(a.grad.buffer))).toBe(true);
            expect(other.metrics).toEqual(a.metrics);
          }
        }
      });

      it('concurrent calls on one batch give the same results as one at a time', { timeout: 60_000 }, async () => {
        const { batch, lp } = randomLossCase(randomBatch(8, { count: 40 }), 8);
        const lp2 = lp.map((x) => x - 0.05);
        const [a, b] = await Promise.all([
          computeLoss(batch, lp, {}, { backend: 'webgpu' }),
          computeLoss(batch, lp2, {}, { backend: 'webgpu' }),
        ]);
        expect(a.grad).toEqual((await computeLoss(batch, lp, {}, { backend: 'webgpu' })).grad);
        expect(b.grad).toEqual((await computeLoss(batch, lp2, {}, { backend: 'webgpu' })).grad);
      });

      it('compact mode in 64-byte chunks equals js and the per-occurrence mode', { timeout: 120_000 }, async () => {
        for (const seed of [1, 2, 3]) {
          const { batch, lp } = randomLossCase(randomBatch(seed, { count: 40 }), seed, { sharedOld: true });
          for (const config of LOSS_CONFIGS.filter((c) => c.policy !== 'gspo')) {
            const plan = buildCompactPlan(batch, config);
            const got = await gpuCompact(plan, lp, config, 64);
            expectEqualsJs(got, lossReference(batch, lp, resolveLossConfig(config)), TOL, `seed ${seed} compact`);
            expectEqualsJs(got, await gpu(batch, lp, config, 64), TOL, `seed ${seed} compact vs per-occurrence`);
          }
        }
      });

      it('takes the chunk size from the environment, and refuses one below 64 bytes, naming the variable or option', async () => {
        const { batch, lp } = randomLossCase(randomBatch(3, { count: 30, alphabet: 2 }), 3);
        const cfg = resolveLossConfig(LOSS_CONFIGS[1]);
        chunked(64, batch, cfg);
        const explicit = await gpu(batch, lp, cfg, 64);
        process.env[CHUNK_BYTES_ENV] = '64';
        const fromEnv = await computeLoss(batch, lp, cfg, { backend: 'webgpu' });
        expect(Buffer.from(fromEnv.grad.buffer).equals(Buffer.from(explicit.grad.buffer))).toBe(true);
        process.env[CHUNK_BYTES_ENV] = '8';
        const err = await computeLoss(batch, lp, {}, { backend: 'webgpu' }).catch((e: unknown) => e);
        expect(err).toBeInstanceOf(TreepackError);
        expect((err as TreepackError).where.field).toBe(CHUNK_BYTES_ENV);
        const opt = await gpu(batch, lp, {}, 8).catch((e: unknown) => e);
        expect((opt as TreepackError).where.field).toBe('chunkBytes');
      });
    }),
  { only: ['webgpu'] },
);

/**
 * 9.4M occurrences (8.4M trainable) in 256 groups of 8 sequences sharing a 1200-token prompt: over the 128 MiB
 * binding limit of the software adapter at 16 bytes per trainable occurrence, so it runs in two chunks there.
 */
function bigBatch(): { batch: LossBatch; lp: Float32Array } {
  const groups = 256;
  const per = 8;
  const prompt = 1200;
  const own = 3400;
  const len = prompt + own;
  const S = groups * per;
  const M = S * len;
  const N = groups * (prompt + per * own);
  const seq_offsets = Int32Array.from({ length: S + 1 }, (_, i) => i * len);
  const seq_positions = new Int32Array(M);
  const loss_mask = new Uint8Array(M);
  const advantages = new Float32Array(M);
  const old_logprobs = new Float32Array(M);
  const ref_logprobs = new Float32Array(M);
  const value = (x: number) => -4 * (((Math.imul(x + 1, 2654435761) >>> 0) % 100_003) / 100_003);
  for (let i = 0; i < S; i++) {
    const g = Math.floor(i / per);
    const base = g * (prompt + per * own);
    const a = ((i % per) - 3.5) / 2;
    for (let t = 0; t < len; t++) {
      const j = i * len + t;
      seq_positions[j] = t < prompt ? base + t : base + prompt + (i % per) * own + (t - prompt);
      // the prompt is trainable after its first 200 tokens, so shared nodes have 8 occurrences each
      loss_mask[j] = t >= 200 && t % 19 !== 0 ? 1 : 0;
      advantages[j] = a;
      old_logprobs[j] = Math.fround(value(seq_positions[j]) + 0.01 * ((j % 7) - 3));
      ref_logprobs[j] = Math.fround(value(seq_positions[j] + 17));
    }
  }
  const lp = Float32Array.from({ length: N }, (_, p) => Math.fround(value(p) + 0.02 * ((p % 5) - 2)));
  return { batch: { input_ids: new Int32Array(N), seq_offsets, seq_positions, loss_mask, advantages, old_logprobs, ref_logprobs }, lp };
}

await describeBackends(
  'loss',
  (_, status) =>
    describe('webgpu loss over the real binding limit', () => {
      it('8.4M trainable occurrences: equals js', { timeout: 300_000 }, async () => {
        const { batch, lp } = bigBatch();
        const limit = status.limits!.maxArrayBytes;
        const cfg = resolveLossConfig({ clip_low: 0.2, clip_high: 0.28, dual_clip: 3, kl: 'k3', kl_coef: 0.01 });
        const { nodeOff } = occStream(batch, cfg);
        const T = nodeOff[nodeOff.length - 1];
        const chunks = planOccChunks(nodeOff, Math.floor(limit / OCC_BYTES), Math.floor(limit / 8) - 1).length;
        console.log(`8.4M-occurrence case: ${T} trainable occurrences in ${chunks} chunk(s) of at most ${limit} bytes`);
        if (T * OCC_BYTES > limit) expect(chunks).toBeGreaterThan(1);
        const got = await computeLoss(batch, lp, cfg, { backend: 'webgpu' });
        const want = lossReference(batch, lp, cfg);
        expect(got.metrics.trainable_tokens).toBe(T);
        close(got.loss, want.loss, TOL, 'loss');
        for (const key of Object.keys(want.metrics) as (keyof LossResult['metrics'])[])
          close(got.metrics[key], want.metrics[key], 1e-4, key);
        let worst = 0;
        for (let p = 0; p < want.grad.length; p++)
          worst = Math.max(worst, Math.abs(got.grad[p] - want.grad[p]) / Math.max(1, Math.abs(want.grad[p])));
        expect(worst).toBeLessThanOrEqual(TOL);
      });
    }),
  { only: ['webgpu'] },
);
