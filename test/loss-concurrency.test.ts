/**
 * Loss results must not depend on timing: on every backend, calls that overlap (different batches, different
 * configs on one batch, per-occurrence and compact mode, different WebGPU chunk layouts) give exactly the bits of
 * the same calls made one at a time. Busy hosts interleave calls in every order; a result that changed with the
 * interleaving would make training irreproducible.
 */
import { expect, it } from 'vitest';
import { computeLoss, computeLossCompact, type BackendName } from '../src/backend/index.js';
import { lossCompactWebGPU, lossWebGPU } from '../src/backend/webgpu/loss.js';
import { buildCompactPlan, resolveLossConfig, type LossConfig, type LossResult } from '../src/loss/index.js';
import type { CompactPlan, LossBatch } from '../src/loss/types.js';
import { describeBackends } from './helpers/backends.js';
import { LOSS_CONFIGS, randomLossCase } from './helpers/loss.js';
import { randomBatch } from './helpers/sequences.js';

interface Call {
  what: string;
  run: () => Promise<LossResult>;
}

/** Same bits: the gradient byte for byte, the loss and every metric with Object.is (so -0 and NaN count too). */
function expectSameBits(got: LossResult, want: LossResult, what: string): void {
  expect(
    Buffer.from(got.grad.buffer, got.grad.byteOffset, got.grad.byteLength).equals(
      Buffer.from(want.grad.buffer, want.grad.byteOffset, want.grad.byteLength),
    ),
    `${what} grad`,
  ).toBe(true);
  expect(Object.is(got.loss, want.loss), `${what} loss ${got.loss} vs ${want.loss}`).toBe(true);
  for (const k of Object.keys(want.metrics) as (keyof LossResult['metrics'])[]) {
    expect(Object.is(got.metrics[k], want.metrics[k]), `${what} ${k} ${got.metrics[k]} vs ${want.metrics[k]}`).toBe(true);
  }
}

function calls(backend: BackendName): Call[] {
  const out: Call[] = [];
  const occ = (b: LossBatch, lp: Float32Array, config: Partial<LossConfig>, chunkBytes?: number) =>
    backend === 'webgpu'
      ? () => lossWebGPU(b, lp, resolveLossConfig(config), { chunkBytes })
      : () => computeLoss(b, lp, config, { backend });
  const compact = (plan: CompactPlan, lp: Float32Array, config: Partial<LossConfig>, chunkBytes?: number) =>
    backend === 'webgpu'
      ? () => lossCompactWebGPU(plan, lp, resolveLossConfig(config), { chunkBytes })
      : () => computeLossCompact(plan, lp, config, { backend });
  const chunk = (k: number) => (backend === 'webgpu' ? [64, 512, undefined][k % 3] : undefined);
  for (let k = 0; k < 6; k++) {
    const seed = 40 + k;
    const { batch, lp } = randomLossCase(randomBatch(seed, { count: 30 + 10 * k, alphabet: 2 + (k % 3) }), seed, { sharedOld: true });
    const config = LOSS_CONFIGS[k % LOSS_CONFIGS.length];
    out.push({ what: `batch ${k} config ${k % LOSS_CONFIGS.length}`, run: occ(batch, lp, config, chunk(k)) });
    // A second config on the same batch object: the WebGPU layout cache is replaced while the first may run.
    const other = LOSS_CONFIGS[(k + 3) % LOSS_CONFIGS.length];
    out.push({
      what: `batch ${k} config ${(k + 3) % LOSS_CONFIGS.length}`,
      run: occ(
        batch,
        lp.map((x) => x - 0.01),
        other,
        chunk(k),
      ),
    });
    if (config.policy !== 'gspo') {
      const plan = buildCompactPlan(batch, config);
      out.push({ what: `batch ${k} compact`, run: compact(plan, lp, config, chunk(k + 1)) });
    }
  }
  return out;
}

await describeBackends('loss', (backend) => {
  it('overlapping calls on different batches, configs and layouts give the bits of calls one at a time', { timeout: 180_000 }, async () => {
    const list = calls(backend);
    const serial: LossResult[] = [];
    for (const c of list) serial.push(await c.run());
    for (let round = 0; round < 3; round++) {
      // Round 0 all at once in order, then reversed and interleaved orders.
      const order = list.map((_, i) => i);
      if (round === 1) order.reverse();
      if (round === 2) order.sort((x, y) => (x % 3) - (y % 3) || x - y);
      const got = await Promise.all(order.map((i) => list[i].run()));
      order.forEach((i, k) => expectSameBits(got[k], serial[i], `round ${round} ${list[i].what}`));
    }
  });
});
