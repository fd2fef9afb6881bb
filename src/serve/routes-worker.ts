/**
 * The routes thread (routes-thread.ts): checks each output's routed experts with recordRoutes and answers the
 * record form, or why the routes cannot be recorded. Asked one output per message, answered in order.
 */
import { parentPort } from 'node:worker_threads';
import { recordRoutes, RoutesDropped } from './routed-experts.js';
import type { FromRoutesWorker, ToRoutesWorker } from './routes-thread.js';

const port = parentPort!;

port.on('message', ({ id, raw, tokens, opts }: ToRoutesWorker) => {
  let reply: FromRoutesWorker;
  try {
    reply = { id, routes: recordRoutes(raw, tokens, opts) };
  } catch (err) {
    reply =
      err instanceof RoutesDropped
        ? { id, dropped: { reason: err.reason, field: err.field, detail: err.detail } }
        : { id, error: (err as Error).message };
  }
  port.postMessage(reply);
});
