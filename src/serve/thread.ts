/**
 * Starts one of the service's worker threads: a module next to this one. Under vitest or tsx the sources are
 * TypeScript, which a worker cannot load by itself, so the worker then registers tsx's loader first.
 */
import { Worker } from 'node:worker_threads';

export function startWorker(module: 'pack-worker', workerData: unknown): Worker {
  if (!import.meta.url.endsWith('.ts')) return new Worker(new URL(`./${module}.js`, import.meta.url), { workerData });
  const url = new URL(`./${module}.ts`, import.meta.url).href;
  return new Worker(`import('tsx/esm/api').then(({ register }) => { register(); return import(${JSON.stringify(url)}); })`, { eval: true, workerData });
}
