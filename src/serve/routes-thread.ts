/**
 * Checking an engine's routed experts off the event loop (routed-experts.ts): decoding and checking the routes of a
 * long call (32k tokens × 48 layers × top-8: 67 MB of base64) takes the better part of a second of CPU, during which
 * a service on the event loop would answer no other tenant. One worker thread, started at the first routed output
 * and again after it died, checks them in the order asked.
 */
import type { Worker } from 'node:worker_threads';
import { RoutesDropped, type DropReason, type RawRoutes, type RecordedRoutes, type RouteOptions } from './routed-experts.js';
import { startWorker } from './thread.js';

export interface ToRoutesWorker {
  id: number;
  raw: RawRoutes;
  tokens: number | undefined;
  opts: RouteOptions;
}
export type FromRoutesWorker =
  | { id: number; routes: RecordedRoutes }
  | { id: number; dropped: { reason: DropReason; field: string; detail: string } }
  | { id: number; error: string };

export class RoutesThread {
  private worker: Worker | undefined;
  private next = 0;
  private readonly waiting = new Map<number, { resolve: (r: RecordedRoutes) => void; reject: (e: Error) => void }>();
  private closed = false;

  /** recordRoutes(raw, tokens, opts) on the thread: the record form, or RoutesDropped saying why not. */
  record(raw: RawRoutes, tokens: number | undefined, opts: RouteOptions): Promise<RecordedRoutes> {
    if (this.closed) return Promise.reject(new Error('the service is closing'));
    const w = (this.worker ??= this.start());
    const id = this.next++;
    const done = new Promise<RecordedRoutes>((resolve, reject) => this.waiting.set(id, { resolve, reject }));
    w.postMessage({ id, raw, tokens, opts } satisfies ToRoutesWorker);
    return done;
  }

  private start(): Worker {
    const w = startWorker('routes-worker', undefined);
    w.unref(); // an idle thread keeps no process alive
    w.on('message', (m: FromRoutesWorker) => {
      const p = this.waiting.get(m.id);
      if (!p) return;
      this.waiting.delete(m.id);
      if ('routes' in m) p.resolve(m.routes);
      else if ('dropped' in m) p.reject(new RoutesDropped(m.dropped.reason, m.dropped.field, m.dropped.detail));
      else p.reject(new Error(m.error));
    });
    const fail = (why: string) => {
      if (this.worker !== w) return;
      this.worker = undefined;
      for (const p of this.waiting.values()) p.reject(new Error(`the routes thread ${why}`));
      this.waiting.clear();
    };
    w.on('error', (err) => fail(`failed: ${err.message}`));
    w.on('exit', (code) => fail(`exited with code ${code}`));
    return w;
  }

  async close(): Promise<void> {
    this.closed = true;
    const w = this.worker;
    this.worker = undefined;
    for (const p of this.waiting.values()) p.reject(new Error('the service is closing'));
    this.waiting.clear();
    await w?.terminate();
  }
}
