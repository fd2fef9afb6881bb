/**
 * FLA's Triton chunk kernels (Gated DeltaNet, KDA) executed on the CPU by Triton's interpreter, bound to treepack's
 * tree execution of the recurrent layers: python/tests/fla, run against the installed wheel in .venv-fla
 * (scripts/python-env.mjs flaEnv: its own venv from python/requirements-fla.txt, never the main .venv, whose CPU
 * path FLA would change). Skipped, with the reason printed, where .venv-fla or the wheel cannot be had; under
 * TREEPACK_REQUIRE_FLA=1 (CI) that fails instead, and no test of the suite may skip.
 */
import { spawnSync } from 'node:child_process';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { flaEnv, wheelEnv } from '../scripts/python-env.mjs';
import { pythonTests } from './helpers/python.js';

const env = flaEnv();
const wheel = env.python ? wheelEnv(env.python) : { python: null, wheel: '', reason: env.reason };
const skipReason = wheel.python ? '' : wheel.reason;
if (skipReason && process.env.TREEPACK_REQUIRE_FLA === '1') {
  throw new Error(`test/gpu-fla.test.ts: TREEPACK_REQUIRE_FLA=1 but ${skipReason}`);
}
if (skipReason) console.log(`test/gpu-fla.test.ts skipped: ${skipReason}`);

describe.skipIf(skipReason !== '')("FLA's kernels under Triton's interpreter (python/tests/fla)", () => {
  const title = 'GDN and KDA on trees: bit for bit with chunk alignment, the torch reference within float32 rounding; none skipped';
  it(title, { timeout: 1_200_000 }, () => {
    const inherited = { ...process.env };
    delete inherited.PYTHONPATH;
    // One thread: the interpreter runs kernel programs one by one in numpy; on a busy host more threads only contend.
    const res = spawnSync(wheel.python!, ['-m', 'unittest', 'discover', '-v', '-s', join(pythonTests, 'fla')], {
      cwd: tmpdir(),
      env: { ...inherited, TRITON_INTERPRET: '1', OMP_NUM_THREADS: '1', PYTHONDONTWRITEBYTECODE: '1' },
      encoding: 'utf8',
      maxBuffer: 64 << 20,
      timeout: 1_190_000,
    });
    const log = `${res.stdout}\n${res.stderr}`;
    expect(res.status, log.slice(-6000)).toBe(0);
    expect(res.stderr).toMatch(/\nOK\b/);
    const figures = res.stdout.split('\n').filter((l) => /bit for bit|reference|FLA kernels launched|Qwen3\.5/.test(l));
    for (const line of figures) console.log(line);
    // Only the bfloat16 test may skip here, and only for the reason it gives (it needs a CUDA device).
    const skipped = res.stderr.match(/^.* \.\.\. skipped .*$/gm) ?? [];
    expect(skipped.filter((line) => !/bfloat16 needs a CUDA device/.test(line))).toEqual([]);
    expect(res.stderr).toMatch(/Ran [4-9] tests/);
  });
});
