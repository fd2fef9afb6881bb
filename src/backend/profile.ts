/**
 * Device time of kernels, as tfjs's `tf.time`: a backend that times its kernels on the device (CUDA events)
 * reports that time here, and `timeKernels(fn)` adds up what the kernels run inside `fn` reported, beside the wall
 * time, which also counts validation, transfers and read-back. The scope is an AsyncLocalStorage, so calls timed
 * concurrently never count each other's kernels.
 */
import { AsyncLocalStorage } from 'node:async_hooks';
import { performance } from 'node:perf_hooks';

interface Tally {
  kernelMs: number;
  reported: boolean;
}

const scope = new AsyncLocalStorage<Tally>();

/** The result of a timed call and the time its kernels took, by op and backend. */
export interface KernelTiming<T> {
  result: T;
  /** Wall time of `fn`, as the caller sees it. */
  wallMs: number;
  /** Device time of the kernels `fn` ran; absent when none of them reports it (every backend but cuda's masks). */
  kernelMs?: number;
}

/**
 * Runs `fn` and says how long it took, and how much of that the device spent in kernels where the backend can
 * tell: what a caller needs to see whether a GPU op is bound by its kernels or by everything around them.
 */
export async function timeKernels<T>(fn: () => Promise<T> | T): Promise<KernelTiming<T>> {
  const tally: Tally = { kernelMs: 0, reported: false };
  const t0 = performance.now();
  const result = await scope.run(tally, fn);
  const wallMs = performance.now() - t0;
  return tally.reported ? { result, wallMs, kernelMs: tally.kernelMs } : { result, wallMs };
}

/** Called by a kernel with its own device time; counted by the enclosing `timeKernels`, if any. */
export function reportKernelMs(ms: number): void {
  const tally = scope.getStore();
  if (!tally) return;
  tally.kernelMs += ms;
  tally.reported = true;
}
