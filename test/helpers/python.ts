/**
 * The Python the Python-side suites run: treepack as installed from the wheel this checkout builds
 * (scripts/python-env.mjs wheelEnv: `pip wheel ./python`, installed into a venv of its own that sees the packages of
 * the Python pythonEnv() finds: TREEPACK_PYTHON, .venv, PATH, else .venv created once). The suites run from a
 * directory outside python/ with no PYTHONPATH, so `import treepack` is the installed package, never the source
 * tree; the install is keyed by a hash of the sources, so it is never stale.
 *
 * A suite skips with the reason printed where there is no Python with numpy, the wheel cannot be built (no compiler,
 * no pip), or it needs torch and there is none; TREEPACK_REQUIRE_WHEEL=1 (CI) fails instead of skipping for the
 * wheel, TREEPACK_REQUIRE_TORCH=1 for torch.
 */
import { spawnSync, type SpawnSyncReturns } from 'node:child_process';
import { tmpdir } from 'node:os';
import { fileURLToPath } from 'node:url';
import { pythonEnv, wheelEnv, type WheelEnv } from '../../scripts/python-env.mjs';

export const pythonDir = fileURLToPath(new URL('../../python', import.meta.url));
/** python/tests and python/tests/trainer, for `-m unittest discover -s`. */
export const pythonTests = `${pythonDir}/tests`;
const env = pythonEnv();
let wheel: WheelEnv | undefined;

/** The installed wheel's venv (built on first use); python null and the reason when it cannot be had. */
export function installed(): WheelEnv {
  wheel ??= env.python === null ? { python: null, wheel: '', reason: env.reason } : wheelEnv(env.python);
  return wheel;
}

export interface PythonRunner {
  /** '' when the suite can run; else why it is skipped. */
  skipReason: string;
  /** Runs the installed package's Python, by default in the system temp directory (outside python/). */
  run(args: string[], opts?: { cwd?: string; env?: Record<string, string>; timeout?: number; input?: string }): SpawnSyncReturns<string>;
}

export function pythonFor(suite: string, needs: 'numpy' | 'torch'): PythonRunner {
  let skipReason = env.python === null ? env.reason : needs === 'torch' && !env.torch ? env.reason : '';
  if (skipReason && needs === 'torch' && process.env.TREEPACK_REQUIRE_TORCH === '1') {
    throw new Error(`${suite}: TREEPACK_REQUIRE_TORCH=1 but ${skipReason}`);
  }
  if (!skipReason && !installed().python) {
    skipReason = installed().reason;
    if (process.env.TREEPACK_REQUIRE_WHEEL === '1') throw new Error(`${suite}: TREEPACK_REQUIRE_WHEEL=1 but ${skipReason}`);
  }
  if (skipReason) console.log(`${suite} skipped: ${skipReason}`);
  const inherited = { ...process.env };
  delete inherited.PYTHONPATH;
  return {
    skipReason,
    run: (args, opts = {}) =>
      spawnSync(installed().python ?? 'python3', args, {
        cwd: opts.cwd ?? tmpdir(),
        env: { ...inherited, PYTHONDONTWRITEBYTECODE: '1', ...opts.env },
        encoding: 'utf8',
        maxBuffer: 64 << 20,
        timeout: opts.timeout,
        input: opts.input,
      }),
  };
}
