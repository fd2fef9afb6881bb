/**
 * The CUDA kernels of native/cuda executed without a GPU: the emulated build (`npm run build:cuda-emulated`,
 * native/cuda/emulate, CONTRIBUTING.md) loaded by the same bindings, then
 * - the per-backend suites on `cuda` (masks, loss, the ABI's status answers, gather) through TREEPACK_CUDA_BINDING,
 *   with TREEPACK_REQUIRE_CUDA=1 and every cuda test passed, none skipped;
 * - the Python test of the CUDA library's loss against the core (tp_cuda_loss_host, tp_cuda_loss) through
 *   TREEPACK_CUDA_LIB, under three orders of the threads (TREEPACK_CUDA_EMULATE_SEED);
 * - the same on the AddressSanitizer build (libasan preloaded into node and Python; the masks up to N = 4096);
 * - negative controls, built from mutated copies of the .cu files: a dropped __syncthreads (loss.cu) and a wrong
 *   shuffle offset (mask.cu) fail the suites; a divergent __syncthreads aborts naming the kernel instead of hanging;
 *   a removed bounds check (gather.cu) is reported by AddressSanitizer.
 * Skipped, with the reason printed, where cmake or a C++ compiler is missing; TREEPACK_REQUIRE_CUDA_EMULATED=1 (CI)
 * fails instead. The builds are the npm scripts' `build:cuda-emulated[-asan]` (build-emu/, build-emu-asan/; reused
 * when up to date); the mutants are the same builds into a temporary directory, of the sources in another one
 * (TREEPACK_CUDA_EMULATE_SOURCES).
 */
import { spawnSync, type SpawnSyncReturns } from 'node:child_process';
import { copyFileSync, existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, describe, expect, it } from 'vitest';
import { pythonFor, pythonTests, type PythonRunner } from './helpers/python.js';

const ROOT = fileURLToPath(new URL('..', import.meta.url));
const CUDA_SOURCES = path.join(ROOT, 'native', 'cuda');
const REQUIRED = process.env.TREEPACK_REQUIRE_CUDA_EMULATED === '1';
const scratch = mkdtempSync(path.join(tmpdir(), 'treepack-cuda-emulated-'));
afterAll(() => rmSync(scratch, { recursive: true, force: true }));

/** '' when cmake and a C++ compiler run here, else why not. */
function toolchainMissing(): string {
  for (const [tool, args] of [
    ['cmake', ['--version']],
    [process.env.CXX ?? 'c++', ['--version']],
  ] as const) {
    if (spawnSync(tool, args, { encoding: 'utf8' }).status !== 0) {
      return `${tool} not found (the emulated CUDA build needs cmake and a C++ compiler)`;
    }
  }
  return '';
}

const missing = toolchainMissing();
if (missing) {
  if (REQUIRED) throw new Error(`TREEPACK_REQUIRE_CUDA_EMULATED=1 but ${missing}`);
  console.log(`test/gpu-cuda-emulated.test.ts skipped: ${missing}`);
}

// The suites' tests that run the cuda backend or the CUDA C ABI, by full name.
const CUDA_TESTS = /on cuda|tp_cuda_loss_host|cuda loader/;
const SUITES = ['mask-parity', 'loss', 'loss-turns', 'loss-concurrency', 'abi', 'native'].map((f) => `test/${f}.test.ts`);
// The suites with the masks up to N = 1000 only (the larger ones take minutes under AddressSanitizer, or once
// mutated fail on every size alike; they run the same kernels).
const SMALL = /on cuda(?!.* (N=4096|N=65536|N=262144|agent batch|one sequence of))|tp_cuda_loss_host|cuda loader/;

interface Build {
  binding: string;
  lib: string;
}

type Script = 'build:cuda-emulated' | 'build:cuda-emulated-asan';
const SCRIPTS = (JSON.parse(readFileSync(path.join(ROOT, 'package.json'), 'utf8')) as { scripts: Record<Script, string> }).scripts;

/** The npm script's cmake-js command, into `out` instead of its own directory when given; throws with the log. */
function build(script: Script, out?: string, env: Record<string, string> = {}): Build {
  const [tool, ...args] = SCRIPTS[script].split(' ');
  const at = args.indexOf('--out') + 1;
  expect(tool === 'cmake-js' && at > 0, `${script}: ${SCRIPTS[script]}`).toBe(true);
  if (out) args[at] = out;
  const cmakeJs = path.join(ROOT, 'node_modules', 'cmake-js', 'bin', 'cmake-js');
  const res = spawnSync(process.execPath, [cmakeJs, ...args], { cwd: ROOT, encoding: 'utf8', maxBuffer: 64 << 20, env: childEnv(env) });
  if (res.status !== 0) throw new Error(`cmake-js ${args.join(' ')} failed (${res.status}):\n${(res.stdout + res.stderr).slice(-4000)}`);
  const dir = path.resolve(ROOT, args[at], 'Release');
  return { binding: path.join(dir, 'treepack_cuda.node'), lib: path.join(dir, 'libtreepack_cuda.so') };
}

const builds = new Map<Script, Build>();
function built(script: Script): Build {
  if (!builds.has(script)) builds.set(script, build(script));
  return builds.get(script)!;
}

/** The build of a copy of native/cuda's .cu files with each [file, from, to] applied (each `from` once). */
function mutant(name: string, edits: [string, string, string][], script: Script): Build {
  const dir = path.join(scratch, name);
  const sources = path.join(dir, 'cuda');
  spawnSync('mkdir', ['-p', sources]);
  for (const f of ['device.cu', 'gather.cu', 'mask.cu', 'loss.cu']) copyFileSync(path.join(CUDA_SOURCES, f), path.join(sources, f));
  for (const [file, from, to] of edits) {
    const text = readFileSync(path.join(sources, file), 'utf8');
    // A kernel rewritten since this test was written must fail here, not leave the mutant equal to the original.
    expect(text.split(from).length - 1, `${file} holds ${JSON.stringify(from)} once`).toBe(1);
    writeFileSync(path.join(sources, file), text.replace(from, to));
  }
  return build(script, path.join(dir, 'build'), { TREEPACK_CUDA_EMULATE_SOURCES: sources });
}

/** LD_PRELOAD and ASAN_OPTIONS for a process that loads an AddressSanitizer build (node and Python are not built with it). */
function asanEnv(): Record<string, string> {
  const lib = spawnSync(process.env.CXX ?? 'c++', ['-print-file-name=libasan.so'], { encoding: 'utf8' }).stdout.trim();
  expect(existsSync(lib), `libasan.so (${lib})`).toBe(true);
  // No leak check: node and Python keep their allocations at exit by design.
  return { LD_PRELOAD: lib, ASAN_OPTIONS: 'detect_leaks=0:abort_on_error=1' };
}

/** The environment of a child vitest or Python: the parent's, less vitest's own variables, plus `env`. */
function childEnv(env: Record<string, string>): NodeJS.ProcessEnv {
  const out: NodeJS.ProcessEnv = {};
  for (const [k, v] of Object.entries(process.env)) if (!k.startsWith('VITEST') && k !== 'NODE_ENV') out[k] = v;
  return { ...out, ...env };
}

interface Assertion {
  fullName: string;
  status: string;
  failureMessages: string[];
}

/** The suites in a child vitest on the CUDA build `b`: its JSON report's test results. */
function suites(b: Build, pattern: RegExp, env: Record<string, string> = {}): { tests: Assertion[]; run: SpawnSyncReturns<string> } {
  const report = path.join(scratch, `report-${Math.random().toString(36).slice(2)}.json`);
  const vitest = path.join(ROOT, 'node_modules', 'vitest', 'vitest.mjs');
  const run = spawnSync(process.execPath, [vitest, 'run', ...SUITES, '-t', pattern.source, '--reporter=json', `--outputFile=${report}`], {
    cwd: ROOT,
    encoding: 'utf8',
    maxBuffer: 64 << 20,
    env: childEnv({ TREEPACK_CUDA_BINDING: b.binding, TREEPACK_CUDA_LIB: b.lib, TREEPACK_REQUIRE_CUDA: '1', ...env }),
  });
  if (!existsSync(report)) throw new Error(`vitest wrote no report (${run.status}):\n${(run.stdout + run.stderr).slice(-4000)}`);
  const json = JSON.parse(readFileSync(report, 'utf8')) as { testResults: { assertionResults: Assertion[] }[] };
  // Only the tests the pattern selects (vitest reports the others as skipped).
  return { tests: json.testResults.flatMap((f) => f.assertionResults).filter((t) => pattern.test(t.fullName)), run };
}

/** Every cuda test of the suites ran and passed, and there are some of each kind. */
function expectAllPassed({ tests, run }: ReturnType<typeof suites>): void {
  const cuda = tests.filter((t) => CUDA_TESTS.test(t.fullName));
  const why = (t: Assertion) => `${t.status}: ${t.fullName} ${t.failureMessages.join(' ').slice(0, 300)}`;
  const bad = cuda.filter((t) => t.status !== 'passed').map(why);
  expect(bad, (run.stdout + run.stderr).slice(-3000)).toEqual([]);
  for (const kind of [/mask parity: cuda/, /^loss on cuda/, /^lossCompact on cuda/, /tp_cuda_loss_host/, /gathers on the GPU/]) {
    expect(cuda.filter((t) => kind.test(t.fullName)).length, `cuda tests matching ${kind}`).toBeGreaterThan(0);
  }
  expect(tests.filter((t) => t.status === 'failed').map((t) => t.fullName)).toEqual([]);
}

let python: PythonRunner | undefined;

/**
 * The Python CUDA-library loss test on `b`: its unittest output; null where there is no Python with numpy or no
 * wheel (pythonFor prints why; under TREEPACK_REQUIRE_CUDA_EMULATED that is a failure).
 */
function pythonLoss(b: Build, env: Record<string, string> = {}): SpawnSyncReturns<string> | null {
  python ??= pythonFor('test/gpu-cuda-emulated.test.ts', 'numpy');
  if (python.skipReason && REQUIRED) throw new Error(`TREEPACK_REQUIRE_CUDA_EMULATED=1 but ${python.skipReason}`);
  if (python.skipReason) return null;
  return python.run(['-m', 'unittest', 'discover', '-v', '-s', pythonTests, '-p', 'test_loss.py', '-k', 'CudaLibraryLossTest'], {
    timeout: 300_000,
    env: { TREEPACK_CUDA_LIB: b.lib, OMP_NUM_THREADS: '1', ...env },
  });
}

function expectPythonPassed(res: SpawnSyncReturns<string> | null): void {
  if (res === null) return;
  const out = res.stdout + res.stderr;
  expect(res.status, out).toBe(0);
  expect(out).toMatch(/test_against_the_core \(.*CudaLibraryLossTest.*\) \.\.\. ok/);
  expect(out).not.toMatch(/skipped/);
}

describe.skipIf(missing !== '')('the CUDA kernels on the CPU emulator', () => {
  it('the emulated device says it is emulated, so nobody takes it for a GPU', { timeout: 600_000 }, () => {
    const b = built('build:cuda-emulated');
    const res = spawnSync(process.execPath, ['--import', 'tsx', path.join(ROOT, 'src', 'cli', 'main.ts'), 'doctor', '--json'], {
      cwd: ROOT,
      encoding: 'utf8',
      env: childEnv({ TREEPACK_CUDA_BINDING: b.binding }),
    });
    expect(res.status, res.stderr).toBe(0);
    const report = JSON.parse(res.stdout) as { backends: { name: string; available: boolean; detail: string }[] };
    const cuda = report.backends.find((x) => x.name === 'cuda');
    expect(cuda).toMatchObject({ available: true, detail: expect.stringMatching(/emulat.*not a GPU/) });
  });

  it('the per-backend suites pass on cuda, nothing skipped', { timeout: 900_000 }, () => {
    expectAllPassed(suites(built('build:cuda-emulated'), CUDA_TESTS));
  });

  it("Python: the CUDA library's loss equals the core's, whatever order the threads run in", { timeout: 600_000 }, (ctx) => {
    const runs = ['0', '1', '2'].map((seed) => pythonLoss(built('build:cuda-emulated'), { TREEPACK_CUDA_EMULATE_SEED: seed }));
    if (runs[0] === null) return ctx.skip('no Python with numpy, or no wheel (printed above)');
    runs.forEach(expectPythonPassed);
  });

  it('the same under AddressSanitizer', { timeout: 900_000 }, () => {
    const b = built('build:cuda-emulated-asan');
    expectAllPassed(suites(b, SMALL, asanEnv()));
    expectPythonPassed(pythonLoss(b, asanEnv()));
  });

  it('negative control: a dropped __syncthreads and a wrong shuffle offset fail the suites', { timeout: 900_000 }, () => {
    const MERGE = '    if (threadIdx.x < w) sh[threadIdx.x].Merge(sh[threadIdx.x + w]);';
    const b = mutant(
      'wrong',
      [
        // BlockReduce: a thread reads a partial sum before its owner has added the other half into it.
        ['loss.cu', `${MERGE}\n    __syncthreads();\n`, `${MERGE}\n`],
        // BlockEndsKernel: lane 0's minimum misses lane 1 (and others), so blocks become full too early.
        ['mask.cu', 'lo = min(lo, __shfl_down_sync(0xffffffffu, lo, off));', 'lo = min(lo, __shfl_down_sync(0xffffffffu, lo, off + 1));'],
      ],
      'build:cuda-emulated',
    );
    const { tests } = suites(b, SMALL);
    const failed = tests.filter((t) => t.status === 'failed').map((t) => t.fullName);
    console.log(`gpu-cuda-emulated: the mutant fails ${failed.length} of ${tests.length} cuda tests:\n  ${failed.join('\n  ')}`);
    // Each mutation is caught by the suite of its own kernels, and nothing but cuda tests fails.
    expect(failed.filter((n) => /mask parity: cuda/.test(n)).length, failed.join('\n')).toBeGreaterThan(0);
    expect(failed.filter((n) => /^(loss|lossCompact) on cuda/.test(n)).length, failed.join('\n')).toBeGreaterThan(0);
    expect(failed.filter((n) => !CUDA_TESTS.test(n))).toEqual([]);
    const py = pythonLoss(b);
    if (py !== null) {
      expect(py.status, py.stdout + py.stderr).not.toBe(0);
      expect(py.stdout + py.stderr).toMatch(/FAIL: test_against_the_core/);
    }
  });

  it('negative control: a divergent barrier aborts naming the kernel; a lost bounds check is an ASan error', { timeout: 900_000 }, () => {
    const b = mutant(
      'divergent',
      [
        // Only thread 0 reaches the first barrier of BlockRowsKernel; a GPU would hang or be undefined.
        [
          'mask.cu',
          '    if (threadIdx.x == 0) base_part = base_full = 0;\n    __syncthreads();\n',
          '    if (threadIdx.x == 0) {\n      base_part = base_full = 0;\n      __syncthreads();\n    }\n',
        ],
        ['gather.cu', 'dst[i] = j >= 0 && j < src_n ? src[j] : 0;', 'dst[i] = src[j];'],
      ],
      'build:cuda-emulated-asan',
    );
    const call = (js: string) =>
      spawnSync(process.execPath, ['-e', `const b = require(${JSON.stringify(b.binding)}); b.init(Error); ${js}`], {
        encoding: 'utf8',
        timeout: 120_000,
        env: childEnv(asanEnv()),
      });
    const barrier = call('b.maskBlocks(Int32Array.from([4, 2, 4, 4]), 2);');
    expect(barrier.error, 'finished before its time limit').toBeUndefined();
    expect(barrier.status === 0).toBe(false);
    const where = String.raw`waits at .*mask\.cu:\d+ for its warp, but thread \(0,0,0\) waits at __syncthreads .*mask\.cu:\d+`;
    const who = String.raw`treepack CUDA emulator: kernel BlockRowsKernel, block \(0,0,0\): thread \(\d+,0,0\)`;
    expect(barrier.stderr).toMatch(new RegExp(`${who} ${where}`));
    const gather = call('b.gatherI32(Int32Array.from([10, 11, 12, 13]), Int32Array.from([3, 0, 7, -1]));');
    expect(gather.error, 'finished before its time limit').toBeUndefined();
    expect(gather.status === 0).toBe(false);
    expect(gather.stderr).toMatch(/AddressSanitizer: heap-buffer-overflow[\s\S]*gather_i32[\s\S]*gather\.cu/);
  });
});
