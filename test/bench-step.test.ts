/**
 * The bench's training-step harness (bench/step.ts → bench/step.py) end to end on the default run's first workload:
 * the sides train the same tokens to the same loss, and the timed steps do not page-fault (glibc's malloc, left to its
 * defaults, gives a 15k-token naive micro-batch's freed tensors back to the OS and faults ~10⁵ pages in again every
 * step, which made the naive side 40% slower than its work on this VM). No timing is asserted.
 */
import { describe, expect, it } from 'vitest';
import { benchStep, GENERATED } from '../bench/step.js';
import { pythonFor } from './helpers/python.js';

const py = pythonFor('test/bench-step.test.ts', 'torch');
const glibc = Boolean((process.report.getReport() as { header?: { glibcVersionRuntime?: string } }).header?.glibcVersionRuntime);

describe.skipIf(py.skipReason !== '')('bench step harness', () => {
  it('times naive and packed on the same loss, without page faults in the timed steps', { timeout: 300_000 }, async () => {
    const section = await benchStep({ full: false, tauBench: null, generated: [GENERATED[0]] });
    expect(section.skipped).toBeUndefined();
    const [w] = section.workloads;
    expect(w.error).toBeUndefined();
    expect(w.mismatches).toEqual({});
    const { naive, packed } = w.sides!;
    expect(naive.grad_norm).toBeGreaterThan(0);
    expect(w.figures!.naive.trainable).toBe(w.figures!.packed.trainable);
    expect(w.figures!.naive.tokens).toBeGreaterThan(3 * w.figures!.packed.tokens);
    // A 3.8× larger micro-batch adds more memory than packed's (activations grow with its tokens).
    if (process.platform === 'linux') expect(naive.peak_bytes!).toBeGreaterThan(1.5 * packed.peak_bytes!);
    if (!glibc) return console.log('bench-step: not glibc, page faults not checked');
    expect(section.allocator).toMatch(/GLIBC_TUNABLES=/);
    console.log(`bench-step: page faults in timed steps: naive ${naive.page_faults}, packed ${packed.page_faults}; peak memory added: naive ${naive.peak_bytes}, packed ${packed.peak_bytes}`);
    expect(naive.page_faults).toBeLessThan(1000);
    expect(packed.page_faults).toBeLessThan(1000);
  });
});
