// Builds the CPU addon build/Release/treepack.node, and the same core as a plain C library for Python's ctypes
// (build/Release/libtreepack_core.so), with node-gyp, offline.
//
//   node scripts/build-native.mjs            npm's `install` script: a failed build only warns (exit 0), since
//                                            treepack still works on its js backend; where a CUDA compiler is found
//                                            it then builds the CUDA library too (`npm run build:cuda`), which also
//                                            only warns when it fails
//   node scripts/build-native.mjs --strict   `npm run build:native`: a failed build exits non-zero (CPU only)
//   TREEPACK_SKIP_NATIVE=1                   builds nothing
//   TREEPACK_SKIP_CUDA=1                     builds no CUDA library at install
//
// node-gyp downloads Node's headers unless --nodedir points at an installed copy, so the build passes the Node
// prefix whenever it holds node_api.h.
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const strict = process.argv.includes('--strict');
const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const addon = path.join(root, 'build', 'Release', 'treepack.node');
const coreName = { win32: 'treepack_core.dll', darwin: 'libtreepack_core.dylib' }[process.platform] ?? 'libtreepack_core.so';
const core = path.join(root, 'build', 'Release', coreName);

if (process.env.TREEPACK_SKIP_NATIVE === '1') {
  console.log('treepack: TREEPACK_SKIP_NATIVE=1, native addon not built; treepack will use the js backend.');
  process.exit(0);
}

/** The node-gyp to run: npm's own (inside npm scripts), the one bundled with this Node's npm, or `npm exec`. */
function nodeGypCommand() {
  const bin = path.dirname(process.execPath);
  const bundled = ['../lib/node_modules', 'node_modules'] // Unix prefix layout, Windows installer layout
    .map((dir) => path.join(bin, dir, 'npm/node_modules/node-gyp/bin/node-gyp.js'));
  for (const script of [process.env.npm_config_node_gyp, ...bundled]) {
    if (script && fs.existsSync(script)) return { command: process.execPath, args: [script], shell: false };
  }
  const win = process.platform === 'win32';
  return { command: win ? 'npm.cmd' : 'npm', args: ['exec', '--no', '--', 'node-gyp'], shell: win };
}

function build() {
  const gyp = nodeGypCommand();
  const args = [...gyp.args, 'rebuild'];
  const prefix = path.dirname(path.dirname(process.execPath));
  if (fs.existsSync(path.join(prefix, 'include', 'node', 'node_api.h'))) args.push(`--nodedir=${prefix}`);
  const r = spawnSync(gyp.command, args, {
    cwd: root,
    shell: gyp.shell,
    stdio: strict ? 'inherit' : 'pipe',
    encoding: 'utf8',
    maxBuffer: 64 * 1024 * 1024,
  });
  const log = `${r.stdout ?? ''}${r.stderr ?? ''}`;
  if (r.error) return { ok: false, why: `could not run node-gyp (${r.error.message})`, log };
  if (r.status !== 0) return { ok: false, why: `node-gyp rebuild exited with ${r.status ?? r.signal}`, log };
  try {
    // A build that links but cannot load (wrong ABI, missing symbol) is as useless as no build.
    createRequire(import.meta.url)(addon).version();
  } catch (e) {
    return { ok: false, why: `the built addon does not load (${e instanceof Error ? e.message : String(e)})`, log };
  }
  if (!fs.existsSync(core)) return { ok: false, why: `node-gyp did not produce ${path.relative(root, core)}`, log };
  return { ok: true };
}

/** The CUDA compiler a build would use: CUDACXX, nvcc on PATH, or the toolkit's default prefix (as CMakeLists.txt). */
function findNvcc() {
  if (process.env.CUDACXX) return fs.existsSync(process.env.CUDACXX) ? process.env.CUDACXX : undefined;
  for (const dir of (process.env.PATH ?? '').split(path.delimiter)) {
    const nvcc = path.join(dir, process.platform === 'win32' ? 'nvcc.exe' : 'nvcc');
    if (dir && fs.existsSync(nvcc)) return nvcc;
  }
  return fs.existsSync('/usr/local/cuda/bin/nvcc') ? '/usr/local/cuda/bin/nvcc' : undefined;
}

/** `npm run build:cuda` (cmake-js: the CUDA addon and C library into build-cmake/Release) on an NVIDIA build host. */
function buildCuda(nvcc) {
  let cmakeJs;
  try {
    cmakeJs = createRequire(import.meta.url).resolve('cmake-js/bin/cmake-js');
  } catch {
    return { ok: false, why: 'cmake-js is not installed (a development dependency: install from a checkout)', log: '' };
  }
  const r = spawnSync(process.execPath, [cmakeJs, 'compile', '--out', 'build-cmake'], {
    cwd: root,
    env: { ...process.env, CUDACXX: nvcc },
    stdio: 'pipe',
    encoding: 'utf8',
    maxBuffer: 64 * 1024 * 1024,
  });
  const log = `${r.stdout ?? ''}${r.stderr ?? ''}`;
  if (r.error || r.status !== 0) return { ok: false, why: `cmake-js compile exited with ${r.error?.message ?? r.status ?? r.signal}`, log };
  return { ok: true };
}

const result = build();
if (result.ok) {
  console.log(`treepack: built ${path.relative(root, addon)} and ${path.relative(root, core)}`);
} else if (strict) {
  console.error(`treepack: native build failed: ${result.why}`);
  process.exit(1);
} else {
  const tail = result.log.trim().split('\n').slice(-20).join('\n');
  if (tail) console.warn(tail);
  console.warn(
    `treepack: WARNING: native addon not built: ${result.why}. treepack will use the js backend ` +
      '(run `npm run build:native` to retry, TREEPACK_SKIP_NATIVE=1 to skip).',
  );
}

if (!strict) {
  const nvcc = process.env.TREEPACK_SKIP_CUDA === '1' ? undefined : findNvcc();
  if (nvcc) {
    console.log(`treepack: ${nvcc} found, building the CUDA library (TREEPACK_SKIP_CUDA=1 to skip)`);
    const cuda = buildCuda(nvcc);
    if (cuda.ok) console.log('treepack: built build-cmake/Release/treepack_cuda.node and libtreepack_cuda.so');
    else {
      const tail = cuda.log.trim().split('\n').slice(-20).join('\n');
      if (tail) console.warn(tail);
      console.warn(
        `treepack: WARNING: CUDA library not built: ${cuda.why}. treepack runs on its other backends ` +
          '(run `npm run build:cuda` to retry, TREEPACK_SKIP_CUDA=1 to skip).',
      );
    }
  }
}
