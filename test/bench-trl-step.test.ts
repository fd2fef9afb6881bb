/**
 * The bench's TRL step harness (bench/trl-step.ts → bench/trl_step.py) end to end on the default run's first
 * workload and a one-layer model: TRL's stock and packed steps train the same micro-batches to the same loss, the
 * forest is smaller than the calls' tokens, and the section prints. No timing is asserted.
 */
import { describe, expect, it } from 'vitest';
import { CPU_SHAPE, GENERATED } from '../bench/step.js';
import { benchTrlStep } from '../bench/trl-step.js';
import { pythonFor } from './helpers/python.js';

const py = pythonFor('test/bench-trl-step.test.ts', 'torch');
const SMALL = { ...CPU_SHAPE, name: 'one-layer shape', hidden: 64, intermediate: 192, layers: 1 };

describe.skipIf(py.skipReason !== '')('bench TRL step harness', () => {
  it('times the stock and packed TRL steps to the same loss', { timeout: 300_000 }, async () => {
    const section = await benchTrlStep({
      full: true,
      tauBench: null,
      generated: [{ ...GENERATED[0], repeats: 1 }],
      shapes: { cpu: [SMALL], cuda: [SMALL] },
    });
    expect(section.skipped).toBeUndefined();
    expect(section.workloads).toHaveLength(1);
    const [w] = section.workloads;
    expect(w.mismatch).toBeNull();
    expect(w.packed_tokens!).toBeLessThan(w.naive_tokens! / 3);
    expect(w.padded_tokens!).toBeGreaterThanOrEqual(w.naive_tokens!);
    expect(w.sides!.packed.loss_value).toBeCloseTo(w.sides!.stock.loss_value, 4);
    expect(w.sides!.stock.loss_value).not.toBe(0);
    expect(section.text).toContain('speedup');
  });
});
