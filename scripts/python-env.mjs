// The Python that runs treepack's trainer side (python/treepack, treepack.torch) for the tests and the bench.
//
//   node scripts/python-env.mjs           prints {"python", "torch", "reason", "source"} as JSON, creating .venv if needed
//   import { pythonEnv } from './python-env.mjs'; pythonEnv()   the same, in process (synchronous)
//
// Order: TREEPACK_PYTHON (a GPU host's own environment, say) → the project's .venv → python3 on PATH, each used
// when it imports torch, transformers and numpy; else .venv is created once from python/requirements-torch.txt with
// pip (`--retries 0 --timeout 5`: an unreachable index fails fast instead of stalling); else the first Python with
// numpy serves the numpy-only parts and `reason` says why torch is missing. TREEPACK_NO_VENV=1 never creates .venv.
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const venv = path.join(root, '.venv');
const requirements = path.join(root, 'python', 'requirements-torch.txt');
const lock = path.join(root, '.venv.lock');
const bin = (dir) => (process.platform === 'win32' ? path.join(dir, 'Scripts', 'python.exe') : path.join(dir, 'bin', 'python'));

/** What `python` can import: 'torch' (torch, transformers and numpy), 'numpy', or an error message. */
function probe(python) {
  const code = 'import importlib.util as u, sys\n' +
    'have = [m for m in ("numpy", "torch", "transformers") if u.find_spec(m)]\n' +
    'print("torch" if len(have) == 3 else "numpy" if "numpy" in have else "none: " + sys.executable)';
  const r = spawnSync(python, ['-c', code], { encoding: 'utf8', timeout: 60_000 });
  if (r.error) return `not runnable (${r.error.message})`;
  if (r.status !== 0) return `exited with ${r.status}: ${(r.stderr || '').trim().split('\n').pop()}`;
  const out = r.stdout.trim();
  return out === 'torch' || out === 'numpy' ? out : 'has neither torch nor numpy';
}

function sleep(ms) {
  Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms);
}

/** Creates .venv in a scratch directory renamed into place, so no reader ever sees a half-installed one. */
function createVenv(base) {
  const scratch = `${venv}.building-${process.pid}`;
  fs.rmSync(scratch, { recursive: true, force: true });
  const steps = [
    [base, ['-m', 'venv', scratch]],
    [bin(scratch), ['-m', 'pip', 'install', '--retries', '0', '--timeout', '5', '--disable-pip-version-check', '-q', '-r', requirements]],
  ];
  console.error(`treepack: creating ${path.relative(root, venv)} from ${path.relative(root, requirements)} (once; about a minute)`);
  for (const [cmd, args] of steps) {
    const r = spawnSync(cmd, args, { encoding: 'utf8', timeout: 30 * 60_000, maxBuffer: 64 << 20 });
    if (r.error || r.status !== 0) {
      fs.rmSync(scratch, { recursive: true, force: true });
      const tail = (r.stderr || r.stdout || r.error?.message || '').trim().split('\n').slice(-3).join(' | ');
      return `\`${[path.basename(cmd), ...args.slice(0, 3)].join(' ')} …\` failed: ${tail}`;
    }
  }
  try {
    fs.renameSync(scratch, venv);
  } catch (e) {
    fs.rmSync(scratch, { recursive: true, force: true });
    if (!fs.existsSync(bin(venv))) return `could not move the new venv into place (${e.message})`;
  }
  return '';
}

/** Runs `fn` holding .venv.lock (a directory: mkdir is atomic); waits for another process's creation. */
function withLock(fn) {
  for (;;) {
    try {
      fs.mkdirSync(lock);
      break;
    } catch (e) {
      if (e.code !== 'EEXIST') throw e;
      // A lock older than the longest creation is left by a killed process.
      const age = Date.now() - (fs.statSync(lock, { throwIfNoEntry: false })?.mtimeMs ?? Date.now());
      if (age > 30 * 60_000) fs.rmSync(lock, { recursive: true, force: true });
      else sleep(500);
    }
  }
  try {
    return fn();
  } finally {
    fs.rmSync(lock, { recursive: true, force: true });
  }
}

/**
 * @param {{create?: boolean}} [opts] create: make .venv when no Python with torch is found (default true, unless
 *   TREEPACK_NO_VENV=1)
 * @returns {{python: string | null, torch: boolean, reason: string, source: string}} python: the interpreter to
 *   run (null when none has numpy); torch: whether it imports torch and transformers; reason: why not, else ''.
 */
export function pythonEnv(opts = {}) {
  const create = (opts.create ?? true) && process.env.TREEPACK_NO_VENV !== '1';
  const explicit = process.env.TREEPACK_PYTHON;
  if (explicit) {
    const got = probe(explicit);
    if (got === 'torch') return { python: explicit, torch: true, reason: '', source: 'TREEPACK_PYTHON' };
    const why = `TREEPACK_PYTHON=${explicit} ${got === 'numpy' ? 'cannot import torch and transformers' : got}`;
    return { python: got === 'numpy' ? explicit : null, torch: false, reason: why, source: 'TREEPACK_PYTHON' };
  }
  const reasons = [];
  let numpyOnly = null;
  const look = () => {
    for (const [python, source] of [[bin(venv), '.venv'], ['python3', 'PATH'], ['python', 'PATH']]) {
      if (source === '.venv' && !fs.existsSync(python)) continue;
      const got = probe(python);
      if (got === 'torch') return { python, torch: true, reason: '', source };
      if (got === 'numpy') numpyOnly ??= { python, source };
      reasons.push(`${python}: ${got === 'numpy' ? 'no torch/transformers' : got}`);
    }
    return null;
  };
  const found = look();
  if (found) return found;
  if (create) {
    const base = ['python3', 'python'].find((p) => !probe(p).startsWith('not runnable'));
    if (!base) reasons.push('no python3 to create .venv with');
    else {
      const made = withLock(() => {
        if (!fs.existsSync(bin(venv))) return createVenv(base);
        // Made meanwhile by another process, or the user's own: never replaced.
        return probe(bin(venv)) === 'torch' ? '' : `${path.relative(root, venv)} exists without torch (pip install -r ${path.relative(root, requirements)} into it, or remove it)`;
      });
      if (!made && probe(bin(venv)) === 'torch') return { python: bin(venv), torch: true, reason: '', source: '.venv' };
      if (made) reasons.push(made);
    }
  }
  const reason = `no Python with torch and transformers (${reasons.join('; ')})`;
  return numpyOnly ? { ...numpyOnly, torch: false, reason } : { python: null, torch: false, reason, source: '' };
}

if (process.argv[1] && path.resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  console.log(JSON.stringify(pythonEnv()));
}
