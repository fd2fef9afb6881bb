/**
 * The service's worker threads: modules next to this one. Under vitest or tsx the sources are TypeScript, which a
 * worker cannot load by itself, so the worker then registers tsx's loader first.
 */
import { Worker } from 'node:worker_threads';

export function startWorker(module: 'pack-worker' | 'compact-worker' | 'routes-worker', workerData: unknown): Worker {
  if (!import.meta.url.endsWith('.ts')) return new Worker(new URL(`./${module}.js`, import.meta.url), { workerData });
  const url = new URL(`./${module}.ts`, import.meta.url).href;
  return new Worker(`import('tsx/esm/api').then(({ register }) => { register(); return import(${JSON.stringify(url)}); })`, {
    eval: true,
    workerData,
  });
}

/** Runs a worker that answers once: its message, or its error. */
export function runWorker<T>(module: 'compact-worker', workerData: unknown): Promise<T> {
  return new Promise((resolve, reject) => {
    const w = startWorker(module, workerData);
    w.once('message', (m: T) => {
      resolve(m);
      void w.terminate();
    });
    w.once('error', reject);
    w.once('exit', (code) => reject(new Error(`${module} exited with code ${code} before answering`)));
  });
}
