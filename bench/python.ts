/** The Python with torch that the bench's trainer-side sections run: scripts/python-env.mjs finds it (TREEPACK_PYTHON,
 * the project .venv, PATH) or makes the project .venv once, and says why when it cannot. */
import { spawnSync } from 'node:child_process';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

export const root = resolve(dirname(fileURLToPath(import.meta.url)), '..');

export interface PythonEnv {
  python: string | null;
  torch: boolean;
  reason: string;
  source: string;
}

export async function findPython(): Promise<PythonEnv> {
  const finder = pathToFileURL(join(root, 'scripts', 'python-env.mjs')).href;
  return import(finder)
    .then((m: { pythonEnv: () => PythonEnv }) => m.pythonEnv())
    .catch((e: Error) => ({ python: null, torch: false, reason: `scripts/python-env.mjs: ${e.message}`, source: '' }));
}

/**
 * glibc's malloc hands big freed blocks back to the OS (blocks over its mmap threshold, and the heap's top past its
 * trim threshold) and faults them in again on the next step. On this VM that cost a naive ≈4× step 1.4 s of 3.4
 * (115k–270k minor faults per step; the packed step, with smaller tensors, had none), and it made packing look
 * better than it is. The Python harnesses (step and trainer side) run with the freed memory kept for reuse, as
 * PyTorch's caching allocator keeps it on CUDA: the mmap threshold at glibc's maximum (32 MiB), no trimming, and
 * transparent huge pages for what still faults in (blocks over 32 MiB, heap growth). A GLIBC_TUNABLES of the user's
 * is kept.
 */
export function harnessAllocator(): { env: Record<string, string>; label: string } {
  if (process.env.GLIBC_TUNABLES) return { env: {}, label: `GLIBC_TUNABLES=${process.env.GLIBC_TUNABLES} (yours)` };
  const tunables = `glibc.malloc.mmap_threshold=${32 << 20}:glibc.malloc.trim_threshold=${2 ** 36}:glibc.malloc.hugetlb=1`;
  return { env: { GLIBC_TUNABLES: tunables }, label: `GLIBC_TUNABLES=${tunables} (freed memory kept for reuse; ignored off glibc)` };
}

/**
 * Runs `bench/<script>` with `args` under the harness's allocator, one thread, the checkout's python/ first: its last
 * stdout line as JSON, or (the failure printed under `title`, the bench's exit code set to 1) why it failed.
 */
export function runBenchScript<T>(python: string, title: string, script: string, args: string[]): { result: T } | { failed: string } {
  const res = spawnSync(python, [join(root, 'bench', script), ...args], {
    cwd: root,
    encoding: 'utf8',
    env: { ...process.env, ...harnessAllocator().env, OMP_NUM_THREADS: '1', PYTHONPATH: join(root, 'python') },
  });
  if (res.status !== 0) {
    console.log(`${title}: FAILED\n${res.stderr.slice(-2000)}`);
    process.exitCode = 1;
    return { failed: `failed: ${res.stderr.slice(-500)}` };
  }
  return { result: JSON.parse(res.stdout.trim().split('\n').pop()!) as T };
}
