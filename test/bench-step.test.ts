/**
 * The bench's training-step harness (bench/step.ts → bench/step.py) end to end on the default run's first workload,
 * on two models (as a CUDA host runs two shapes; here two small ones, the second a hybrid whose Gated DeltaNet layers
 * run as a tree on the packed side), plus a CUDA-only workload reported
 * skipped on CPU: the sides train the same tokens to the same loss on each model, and the timed steps do not
 * page-fault (glibc's malloc, left to its defaults, gives a 15k-token naive micro-batch's freed tensors back to the
 * OS and faults ~10⁵ pages in again every step, which made the naive side 40% slower than its work on this VM).
 * No timing is asserted.
 */
import { describe, expect, it } from 'vitest';
import { benchStep, CPU_HYBRID_SHAPE, CPU_SHAPE, GENERATED } from '../bench/step.js';
import { pythonFor } from './helpers/python.js';

const py = pythonFor('test/bench-step.test.ts', 'torch');
const glibc = Boolean((process.report.getReport() as { header?: { glibcVersionRuntime?: string } }).header?.glibcVersionRuntime);
const SMALL = { ...CPU_HYBRID_SHAPE, name: 'two-layer hybrid shape', hidden: 64, intermediate: 192, layers: 2, linear_layers: 1 };

describe.skipIf(py.skipReason !== '')('bench step harness', () => {
  // One harness run answers both tests: one timing per side, as nothing here reads the times, on one torch thread: under
  // CI's busy loops two OpenMP threads wait on each other at every small op, and the hybrid's naive step (1.8 s idle)
  // took 56 s, so best of 2 ran past the budget.
  let run: ReturnType<typeof benchStep> | undefined;
  // The second workload is for CUDA hosts only: packed, then reported skipped here.
  const cudaOnly = { ...GENERATED[0], label: 'CUDA only', devices: ['cuda' as const] };
  const harness = () =>
    (run ??= benchStep({
      full: false,
      tauBench: null,
      generated: [GENERATED[0], cudaOnly],
      shapes: { cpu: [CPU_SHAPE, SMALL], cuda: [] },
      repeats: 1,
      threads: 1,
    }));

  it('times naive and packed to the same loss on each model', { timeout: 600_000 }, async () => {
    const section = await harness();
    expect(section.skipped).toBeUndefined();
    expect(section.deviceType).toBe('cpu');
    // The baseline is what a trainer runs today: stock sdpa on each sequence, not tree attention on chains.
    expect(section.naiveAttention).toBe('transformers sdpa (one sequence per call, is_causal)');
    expect(section.packedAttention).toBe('treepack block-sparse SDPA');
    const skipped = section.workloads.filter((w) => w.skipped);
    expect(skipped.map((w) => [w.name, w.skipped])).toEqual([[expect.stringContaining('CUDA only'), 'timed on cuda hosts only']]);
    expect(skipped[0].compression).toBeGreaterThan(3);
    const timed = section.workloads.filter((w) => !w.skipped);
    expect(timed.map((w) => [w.name.split(' · ')[0], w.shape?.name])).toEqual([
      [CPU_SHAPE.name, CPU_SHAPE.name],
      [SMALL.name, SMALL.name],
    ]);
    for (const w of timed) {
      expect(w.error).toBeUndefined();
      expect(w.mismatches).toEqual({});
      expect(w.sides!.naive.grad_norm).toBeGreaterThan(0);
      expect(w.figures!.naive.trainable).toBe(w.figures!.packed.trainable);
      expect(w.figures!.naive.tokens).toBeGreaterThan(3 * w.figures!.packed.tokens);
      expect([w.sides!.naive.attention, w.sides!.packed.attention]).toEqual([section.naiveAttention, section.packedAttention]);
      // The stock side visits each sequence's causal tiles; the block path its listed tiles and padding.
      expect(w.figures!.naive.executed_blocks).toBe(w.figures!.naive.causal_tiles);
      expect(w.figures!.packed.executed_blocks).toBeGreaterThanOrEqual(w.figures!.packed.blocks);
    }
    // Different models: different gradients of the same loss.
    expect(timed[0].sides!.naive.grad_norm).not.toBe(timed[1].sides!.naive.grad_norm);
    // The hybrid's recurrent layers are timed on both sides, and its packed side runs them by depth level.
    expect(timed[0].sides!.packed.recurrent_forward).toBeUndefined();
    expect(timed[1].sides!.packed.recurrent_forward).toBeGreaterThan(0);
    expect(timed[1].figures!.packed.levels).toBeGreaterThan(1);
    const { naive, packed } = timed[0].sides!;
    // A 3.8× larger micro-batch adds more memory than packed's (activations grow with its tokens; 1.5× measured with
    // stock sdpa on the naive side, 3.8× with tree attention on chains, whose per-call mask buffers grew with it).
    if (process.platform === 'linux') expect(naive.peak_bytes!).toBeGreaterThan(1.2 * packed.peak_bytes!);
  });

  it('the timed steps do not page-fault under glibc', { timeout: 600_000 }, async (ctx) => {
    if (!glibc) return ctx.skip('not glibc: the allocator setting and page faults are glibc-specific');
    const section = await harness();
    const { naive, packed } = section.workloads.find((w) => !w.skipped)!.sides!;
    expect(section.allocator).toMatch(/GLIBC_TUNABLES=/);
    console.log(
      `bench-step: page faults in timed steps: naive ${naive.page_faults}, packed ${packed.page_faults}; peak memory added: naive ${naive.peak_bytes}, packed ${packed.peak_bytes}`,
    );
    expect(naive.page_faults).toBeLessThan(1000);
    expect(packed.page_faults).toBeLessThan(1000);
  });
});
