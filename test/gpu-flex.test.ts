/**
 * Compiled FlexAttention, the kernel the GPU path runs (python/treepack/torch/compiled_flex.py): the Python suite
 * python/tests/gpu/test_flex_compiled.py, run against the installed wheel (test/helpers/python.ts). On a CPU host it
 * compiles flex's forward with inductor and checks it against the block-sparse path (adversarial forests, windows,
 * sinks, step-plan rows), that the kernel reads the block lists, and that 13 micro-batch lengths compile once per
 * ladder rung. It skips with the reason printed where torch is missing, and fails instead under
 * TREEPACK_REQUIRE_TORCH=1 (CI); only its CUDA-only test may skip.
 */
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { pythonFor, pythonTests } from './helpers/python.js';

const py = pythonFor('test/gpu-flex.test.ts', 'torch');

describe.skipIf(py.skipReason !== '')('compiled FlexAttention (python/tests/gpu)', () => {
  // About ten inductor compilations of 10-20 s each on a busy 2-core host.
  it('compiled flex equals the block path, reads the block lists, and compiles once per ladder rung', { timeout: 1_200_000 }, () => {
    // One OpenMP thread: on a shared, busy host more threads only contend.
    const res = py.run(['-m', 'unittest', 'discover', '-v', '-s', join(pythonTests, 'gpu'), '-p', 'test_flex_compiled.py'], {
      timeout: 1_190_000,
      env: { OMP_NUM_THREADS: '1' },
    });
    const log = res.stderr;
    expect(res.status, log.slice(-4000)).toBe(0);
    expect(log).toMatch(/\nOK\b/);
    const counted = log.match(/^compiled flex on .*$/m);
    expect(counted, 'the compilation count was not reported').not.toBeNull();
    console.log(counted![0]);
    const skipped = log.match(/^.* \.\.\. skipped .*$/gm) ?? [];
    console.log(`compiled flex: ${skipped.length} test(s) skipped here: ${skipped.join('; ')}`);
    expect(skipped.filter((line) => !/skipped 'needs CUDA'$/.test(line))).toEqual([]);
  });
});
