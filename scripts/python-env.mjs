// The Python that runs treepack's trainer side (python/treepack, treepack.torch) for the tests and the bench.
//
//   node scripts/python-env.mjs           prints {"python", "torch", "reason", "source"} as JSON, creating .venv if needed
//   node scripts/python-env.mjs --wheel   the same, then builds and installs the wheel (wheelEnv) and prints its venv
//   import { pythonEnv } from './python-env.mjs'; pythonEnv()   the same, in process (synchronous)
//   import { wheelEnv } from './python-env.mjs'; wheelEnv(python)  this checkout's treepack installed for `python`
//   node scripts/python-env.mjs --fla     .venv-fla (flaEnv), created if needed, and the wheel installed for it
//   node scripts/python-env.mjs --oldest  .venv-oldest (oldestEnv: the oldest supported transformers and TRL), and the wheel
//   import { lintEnv } from './python-env.mjs'; lintEnv()   .venv-lint: ruff, mypy, clang-format (npm run lint / format)
//
// Order: TREEPACK_PYTHON (a GPU host's own environment, say) → the project's .venv → python3 on PATH, each used
// when it imports torch, transformers and numpy; else .venv is created once from python/requirements-torch.txt with
// pip (`--retries 0 --timeout 5`: an unreachable index fails fast instead of stalling); else the first Python with
// numpy serves the numpy-only parts and `reason` says why torch is missing. TREEPACK_NO_VENV=1 never creates .venv.
import { spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const venv = path.join(root, '.venv');
const requirements = path.join(root, 'python', 'requirements-torch.txt');
const lock = path.join(root, '.venv.lock');
const flaVenv = path.join(root, '.venv-fla');
const flaRequirements = path.join(root, 'python', 'requirements-fla.txt');
const oldestVenv = path.join(root, '.venv-oldest');
const oldestRequirements = path.join(root, 'python', 'requirements-oldest.txt');
const lintVenv = path.join(root, '.venv-lint');
const lintRequirements = path.join(root, 'python', 'requirements-dev.txt');
const wheelCache = path.join(root, '.cache', 'python-wheel');
const bin = (dir) => (process.platform === 'win32' ? path.join(dir, 'Scripts', 'python.exe') : path.join(dir, 'bin', 'python'));

/** What `python` can import: 'torch' (torch, transformers and numpy), 'numpy', or an error message. */
function probe(python) {
  const code =
    'import importlib.util as u, sys\n' +
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

/**
 * Creates `dir` (.venv) from `reqs` in a scratch directory renamed into place, so no reader ever sees a half-installed
 * one; '' when made, else what failed. With `over` (an interpreter), the new venv sees `over`'s packages behind its
 * own (linkSitePackages), and pip installs only what they lack or what `reqs` pins otherwise.
 */
export function createVenv(base, dir = venv, reqs = requirements, over = null) {
  const scratch = `${dir}.building-${process.pid}`;
  fs.rmSync(scratch, { recursive: true, force: true });
  const steps = [
    [base, ['-m', 'venv', '--prompt', path.basename(dir), scratch]],
    ...(over ? [() => linkSitePackages(over, bin(scratch))] : []),
    [bin(scratch), ['-m', 'pip', 'install', '--retries', '0', '--timeout', '5', '--disable-pip-version-check', '-q', '-r', reqs]],
  ];
  console.error(`treepack: creating ${path.relative(root, dir)} from ${path.relative(root, reqs)} (once; about a minute)`);
  for (const s of steps) {
    if (typeof s === 'function') {
      const why = s();
      if (why) {
        fs.rmSync(scratch, { recursive: true, force: true });
        return why;
      }
      continue;
    }
    const [cmd, args] = s;
    const r = spawnSync(cmd, args, { encoding: 'utf8', timeout: 30 * 60_000, maxBuffer: 64 << 20 });
    if (r.error || r.status !== 0) {
      fs.rmSync(scratch, { recursive: true, force: true });
      const tail = (r.stderr || r.stdout || r.error?.message || '').trim().split('\n').slice(-3).join(' | ');
      return `\`${[path.basename(cmd), ...args.slice(0, 3)].join(' ')} …\` failed: ${tail}`;
    }
  }
  try {
    renameVenv(scratch, dir);
  } catch (e) {
    fs.rmSync(scratch, { recursive: true, force: true });
    if (!fs.existsSync(bin(dir))) return `could not move the new venv into place (${e.message})`;
  }
  return '';
}

/**
 * Moves a venv from `from` to `to`. Its scripts name their interpreter by absolute path (pip's shebangs, activate's
 * VIRTUAL_ENV, pyvenv.cfg's command): they are rewritten to name `to` first, else `to`/bin/pip would run the
 * interpreter of a folder that no longer exists.
 */
function renameVenv(from, to) {
  const binDir = path.dirname(bin(from));
  for (const file of [...fs.readdirSync(binDir).map((name) => path.join(binDir, name)), path.join(from, 'pyvenv.cfg')]) {
    const st = fs.lstatSync(file, { throwIfNoEntry: false });
    if (!st?.isFile()) continue; // python itself is a link to the base interpreter
    const text = fs.readFileSync(file, 'latin1');
    if (text.includes(from)) fs.writeFileSync(file, text.split(from).join(to), 'latin1');
  }
  fs.renameSync(from, to);
}

/** Runs `fn` holding `lockDir` (a directory: mkdir is atomic); waits for another process's creation. */
function withLock(fn, lockDir = lock) {
  for (;;) {
    try {
      fs.mkdirSync(lockDir);
      break;
    } catch (e) {
      if (e.code !== 'EEXIST') throw e;
      // A lock older than the longest creation is left by a killed process.
      const age = Date.now() - (fs.statSync(lockDir, { throwIfNoEntry: false })?.mtimeMs ?? Date.now());
      if (age > 30 * 60_000) fs.rmSync(lockDir, { recursive: true, force: true });
      else sleep(500);
    }
  }
  try {
    return fn();
  } finally {
    fs.rmSync(lockDir, { recursive: true, force: true });
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
    for (const [python, source] of [
      [bin(venv), '.venv'],
      ['python3', 'PATH'],
      ['python', 'PATH'],
    ]) {
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
        return probe(bin(venv)) === 'torch'
          ? ''
          : `${path.relative(root, venv)} exists without torch (pip install -r ${path.relative(root, requirements)} into it, or remove it)`;
      });
      if (!made && probe(bin(venv)) === 'torch') return { python: bin(venv), torch: true, reason: '', source: '.venv' };
      if (made) reasons.push(made);
    }
  }
  const reason = `no Python with torch and transformers (${reasons.join('; ')})`;
  return numpyOnly ? { ...numpyOnly, torch: false, reason } : { python: null, torch: false, reason, source: '' };
}

/**
 * The Python that runs FLA's Triton kernels under Triton's interpreter (python/tests/fla): .venv-fla, created once
 * from python/requirements-fla.txt (torch, transformers, numpy < 2.4, triton, fla-core, flash-linear-attention) like
 * .venv, under a lock of its own. A separate environment because transformers binds FLA at import for every device
 * once it is installed, which would change what the main .venv's CPU suites run. TREEPACK_NO_VENV=1 never creates
 * it; an existing one that lacks a package is reported, never replaced.
 *
 * @returns {{python: string | null, reason: string}} its interpreter, or null and why not
 */
export function flaEnv() {
  const modules = ['numpy', 'torch', 'transformers', 'triton', 'fla'];
  const missing = () => {
    const code = `import importlib.util as u; print(" ".join(m for m in ${JSON.stringify(modules)} if not u.find_spec(m)))`;
    const r = spawnSync(bin(flaVenv), ['-c', code], { encoding: 'utf8', timeout: 60_000 });
    return r.status === 0 ? r.stdout.trim() : `not runnable (${(r.stderr || r.error?.message || '').trim().split('\n').pop()})`;
  };
  const rel = path.relative(root, flaVenv);
  if (!fs.existsSync(bin(flaVenv))) {
    if (process.env.TREEPACK_NO_VENV === '1') return { python: null, reason: `${rel} does not exist and TREEPACK_NO_VENV=1` };
    const base = ['python3', 'python'].find((p) => !probe(p).startsWith('not runnable'));
    if (!base) return { python: null, reason: `no python3 to create ${rel} with` };
    const made = withLock(() => (fs.existsSync(bin(flaVenv)) ? '' : createVenv(base, flaVenv, flaRequirements)), `${flaVenv}.lock`);
    if (made) return { python: null, reason: made };
  }
  const lacks = missing();
  const fix = `pip install -r ${path.relative(root, flaRequirements)} into it, or remove it`;
  if (lacks) return { python: null, reason: `${rel} lacks ${lacks} (${fix})` };
  return { python: bin(flaVenv), reason: '' };
}

/**
 * The trainer side on the oldest supported releases (python/requirements-oldest.txt, the lower bounds of
 * python/pyproject.toml's extras): .venv-oldest, created once like .venv under a lock of its own. It holds only
 * those pins and sees the packages of `python` (pythonEnv().python) behind its own, so it costs one transformers
 * install rather than a second torch. It keeps a copy of the pins it was made from and is made again when they
 * change (a raised lower bound). TREEPACK_NO_VENV=1 never creates it.
 *
 * @param {string} python the interpreter with torch whose other packages it sees
 * @returns {{python: string | null, reason: string}} its interpreter, or null and why not
 */
export function oldestEnv(python) {
  const rel = path.relative(root, oldestVenv);
  const pins = fs.readFileSync(oldestRequirements, 'utf8');
  const made = path.join(oldestVenv, 'requirements-oldest.txt');
  const current = () => fs.existsSync(bin(oldestVenv)) && fs.existsSync(made) && fs.readFileSync(made, 'utf8') === pins;
  if (!current()) {
    if (process.env.TREEPACK_NO_VENV === '1') return { python: null, reason: `${rel} is missing or stale and TREEPACK_NO_VENV=1` };
    const failed = withLock(() => {
      if (current()) return '';
      fs.rmSync(oldestVenv, { recursive: true, force: true });
      const why = createVenv(python, oldestVenv, oldestRequirements, python);
      if (!why) fs.writeFileSync(made, pins);
      return why;
    }, `${oldestVenv}.lock`);
    if (failed) return { python: null, reason: failed };
  }
  return { python: bin(oldestVenv), reason: '' };
}

/**
 * The pinned linters and formatters of python/requirements-dev.txt (ruff, mypy, clang-format) in .venv-lint, which
 * `npm run lint` and `npm run format` run. Created once, under a lock of its own, and made anew when the pins change
 * (it holds nothing but those tools: a copy of the requirements it was made from is its key).
 *
 * @returns {{python: string | null, reason: string}} its interpreter (run each tool as a module: the venv is built
 *   in a scratch directory, so its bin/ scripts name a path that is gone), or null and why not
 */
export function lintEnv() {
  const stamp = path.join(lintVenv, 'requirements-dev.txt');
  const want = fs.readFileSync(lintRequirements, 'utf8');
  const current = () => fs.existsSync(bin(lintVenv)) && fs.readFileSync(stamp, { encoding: 'utf8', flag: 'a+' }) === want;
  if (!current()) {
    const base = ['python3', 'python'].find((p) => !probe(p).startsWith('not runnable'));
    if (!base) return { python: null, reason: 'no python3 to create .venv-lint with' };
    const made = withLock(() => {
      if (current()) return '';
      fs.rmSync(lintVenv, { recursive: true, force: true });
      const err = createVenv(base, lintVenv, lintRequirements);
      if (!err) fs.writeFileSync(stamp, want);
      return err;
    }, `${lintVenv}.lock`);
    if (made) return { python: null, reason: made };
  }
  return { python: bin(lintVenv), reason: '' };
}

/** Every file the wheel is built from (the package, its build files, the C core), for the install's key. */
function wheelSources() {
  const out = [];
  const walk = (rel) => {
    const abs = path.join(root, rel);
    const st = fs.statSync(abs, { throwIfNoEntry: false });
    if (!st) return;
    if (st.isDirectory()) {
      for (const name of fs.readdirSync(abs).sort()) if (name !== '__pycache__') walk(path.join(rel, name));
    } else if (!rel.endsWith('.pyc') && !rel.endsWith('.so')) out.push(rel);
  };
  for (const rel of ['python/pyproject.toml', 'python/CMakeLists.txt', 'python/treepack', 'native/core']) walk(rel);
  return out;
}

/** Runs a build or install step; '' when it succeeded, else what failed with the end of its output. */
function step(cmd, args, opts = {}) {
  const r = spawnSync(cmd, args, { encoding: 'utf8', timeout: 20 * 60_000, maxBuffer: 64 << 20, ...opts });
  if (!r.error && r.status === 0) return '';
  const tail = (r.stderr || r.stdout || r.error?.message || '').trim().split('\n').slice(-4).join(' | ');
  return `\`${[path.basename(cmd), ...args.slice(0, 4)].join(' ')} …\` failed: ${tail}`;
}

/**
 * This checkout's treepack as a user gets it: the wheel built from python/ (`pip wheel`, which compiles the C core)
 * and installed into a venv of its own under .cache/python-wheel/<key>, which sees `python`'s packages (torch,
 * numpy, safetensors) through a .pth file but holds treepack only as installed, never the source tree. The key
 * hashes the interpreter and every source file of the wheel, so an edit to the Python or C sources reinstalls and a
 * stale install is never tested; building one removes those made over an hour ago. Built once per key, under a lock
 * (the suites share it).
 *
 * @param {string} python an interpreter with numpy and safetensors (pythonEnv().python)
 * @returns {{python: string | null, wheel: string, reason: string}} the venv's interpreter and the wheel file, or
 *   null and why not (no compiler, no pip, no scikit-build-core)
 */
export function wheelEnv(python) {
  const hash = createHash('sha256').update(python);
  for (const rel of wheelSources()) hash.update(`\0${rel}\0`).update(fs.readFileSync(path.join(root, rel)));
  const key = hash.digest('hex').slice(0, 16);
  const dir = path.join(wheelCache, key);
  const result = () => {
    const wheel = fs.existsSync(dir) ? fs.readdirSync(dir).find((f) => f.endsWith('.whl')) : undefined;
    return wheel && fs.existsSync(bin(path.join(dir, 'venv')))
      ? { python: bin(path.join(dir, 'venv')), wheel: path.join(dir, wheel), reason: '' }
      : null;
  };
  const ready = result();
  if (ready) return ready;
  fs.mkdirSync(wheelCache, { recursive: true });
  const failed = withLock(
    () => {
      if (result()) return '';
      // Older installs go once no suite can still be running them (one started before the sources changed).
      for (const old of fs.readdirSync(wheelCache)) {
        const stale = Date.now() - fs.statSync(path.join(wheelCache, old)).mtimeMs > 60 * 60_000;
        if (stale) fs.rmSync(path.join(wheelCache, old), { recursive: true, force: true });
      }
      const scratch = `${dir}.building-${process.pid}`;
      const venvDir = path.join(scratch, 'venv');
      const pip = ['-m', 'pip', '--disable-pip-version-check', '-q'];
      // The tests' Python builds the wheel without an isolated build env when it has scikit-build-core (no index
      // needed); else pip fetches the build backend as for any user.
      const isolated = spawnSync(python, ['-c', 'import scikit_build_core'], { encoding: 'utf8' }).status !== 0;
      console.error(`treepack: building the Python wheel into ${path.relative(root, dir)} (sources changed or first use)`);
      const why =
        step(python, [
          ...pip,
          'wheel',
          '--no-deps',
          ...(isolated ? ['--retries', '0', '--timeout', '5'] : ['--no-build-isolation']),
          '-w',
          scratch,
          path.join(root, 'python'),
        ]) ||
        step(python, ['-m', 'venv', venvDir]) ||
        linkSitePackages(python, bin(venvDir)) ||
        // Dependencies `python` lacks (safetensors, say) come from the index; those it has are kept.
        step(bin(venvDir), [
          ...pip,
          'install',
          '--retries',
          '0',
          '--timeout',
          '5',
          ...fs
            .readdirSync(scratch)
            .filter((f) => f.endsWith('.whl'))
            .map((f) => path.join(scratch, f)),
        ]);
      if (why) {
        fs.rmSync(scratch, { recursive: true, force: true });
        return why;
      }
      fs.renameSync(scratch, dir);
      return '';
    },
    path.join(root, '.cache', 'python-wheel.lock'),
  );
  return result() ?? { python: null, wheel: '', reason: `cannot build and install the treepack wheel: ${failed}` };
}

/**
 * A .pth in the venv's site-packages naming every site directory on `python`'s path, in its order (those its own
 * .pth files add too, as in .venv-oldest): its packages are found after the venv's own.
 */
function linkSitePackages(python, venvPython) {
  const own = spawnSync(
    venvPython,
    ['-c', 'import sysconfig, json; p = sysconfig.get_paths(); print(json.dumps(sorted({p["purelib"], p["platlib"]})))'],
    { encoding: 'utf8' },
  );
  const base = spawnSync(
    python,
    ['-c', 'import sys, json; print(json.dumps([p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]))'],
    { encoding: 'utf8' },
  );
  if (base.status !== 0 || own.status !== 0) return `cannot read the site-packages of ${python}: ${base.stderr || own.stderr}`;
  fs.writeFileSync(path.join(JSON.parse(own.stdout)[0], '_treepack_test_deps.pth'), JSON.parse(base.stdout).join('\n') + '\n');
  return '';
}

const main = process.argv[1] && path.resolve(process.argv[1]) === fileURLToPath(import.meta.url);
if (main && process.argv.includes('--oldest')) {
  const env = pythonEnv();
  const oldest = env.torch ? oldestEnv(env.python) : { python: null, reason: env.reason };
  const wheel = oldest.python ? wheelEnv(oldest.python) : { python: null, wheel: '', reason: oldest.reason };
  console.log(JSON.stringify(wheel));
  if (!wheel.python) process.exitCode = 1;
} else if (main && process.argv.includes('--fla')) {
  const env = flaEnv();
  const wheel = env.python ? wheelEnv(env.python) : { python: null, wheel: '', reason: env.reason };
  console.log(JSON.stringify(wheel));
  if (!wheel.python) process.exitCode = 1;
} else if (main) {
  const env = pythonEnv();
  console.log(JSON.stringify(env));
  if (process.argv.includes('--wheel')) {
    const wheel = env.python ? wheelEnv(env.python) : { python: null, wheel: '', reason: env.reason };
    console.log(JSON.stringify(wheel));
    if (!wheel.python) process.exitCode = 1;
  }
}
