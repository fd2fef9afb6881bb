/**
 * The Python the Python-side suites run (scripts/python-env.mjs: TREEPACK_PYTHON, .venv, PATH, else .venv created
 * once), with PYTHONPATH on python/. A suite that needs torch skips with the reason printed, unless
 * TREEPACK_REQUIRE_TORCH=1 (CI), where a missing torch fails the suite instead.
 */
import { spawnSync, type SpawnSyncReturns } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { pythonEnv } from '../../scripts/python-env.mjs';

export const pythonDir = fileURLToPath(new URL('../../python', import.meta.url));
const env = pythonEnv();

export interface PythonRunner {
  /** '' when the suite can run; else why it is skipped. */
  skipReason: string;
  run(args: string[], opts?: { cwd?: string; env?: Record<string, string>; timeout?: number; input?: string }): SpawnSyncReturns<string>;
}

export function pythonFor(suite: string, needs: 'numpy' | 'torch'): PythonRunner {
  let skipReason = env.python === null ? env.reason : needs === 'torch' && !env.torch ? env.reason : '';
  if (skipReason && needs === 'torch' && process.env.TREEPACK_REQUIRE_TORCH === '1') {
    throw new Error(`${suite}: TREEPACK_REQUIRE_TORCH=1 but ${skipReason}`);
  }
  if (skipReason) console.log(`${suite} skipped: ${skipReason}`);
  return {
    skipReason,
    run: (args, opts = {}) =>
      spawnSync(env.python ?? 'python3', args, {
        cwd: opts.cwd ?? pythonDir,
        env: { ...process.env, PYTHONPATH: pythonDir, PYTHONDONTWRITEBYTECODE: '1', ...opts.env },
        encoding: 'utf8',
        maxBuffer: 64 << 20,
        timeout: opts.timeout,
        input: opts.input,
      }),
  };
}
