/**
 * The trainer side in PyTorch (python/treepack/torch): the Python suites in python/tests/trainer, run with the
 * Python scripts/python-env.mjs finds or creates (.venv with torch + transformers). They skip with the reason
 * printed where none can be had, and fail instead under TREEPACK_REQUIRE_TORCH=1 (CI).
 */
import { describe, expect, it } from 'vitest';
import { pythonFor } from './helpers/python.js';

const py = pythonFor('test/python-torch.test.ts', 'torch');

describe.skipIf(py.skipReason !== '')('treepack.torch (python/tests/trainer)', () => {
  it('every trainer-side suite passes, none skipped', { timeout: 600_000 }, () => {
    const res = py.run(['-m', 'unittest', 'discover', '-v', '-s', 'tests/trainer'], { timeout: 590_000 });
    const log = res.stderr;
    expect(res.status, log.slice(-4000)).toBe(0);
    expect(log).toMatch(/\nOK\b/);
    // A suite that skips (core library or torch missing) must not pass silently here; only CUDA-only tests may skip.
    const skipped = log.match(/^.* \.\.\. skipped .*$/gm) ?? [];
    console.log(`treepack.torch: ${skipped.length} CUDA-only test(s) skipped here`);
    expect(skipped.filter((line) => !/CUDA/.test(line))).toEqual([]);
  });
});
