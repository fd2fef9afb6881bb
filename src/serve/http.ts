/**
 * The HTTP shell around the service: authentication, errors as JSON naming the field, `/healthz`, `/metrics`,
 * and the trainer's routes (`GET /v1/batches/next`, `POST /v1/batches/{id}/ack`, `GET /v1/feed`, `GET /v1/quarantine`).
 */
import { timingSafeEqual } from 'node:crypto';
import type { FastifyError, FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { TreepackError } from '../errors.js';
import { EngineError } from './engine.js';
import { bearer } from './gateway.js';
import { checkId, MAX_ID_LENGTH, PoolError } from './pool.js';
import { QUARANTINE_LIST_MAX } from './quarantine.js';
import type { Recorder } from './recorder.js';

/** What these routes use of the recording core. */
export type HttpCore = Pick<Recorder, 'pool' | 'feed' | 'opts' | 'metrics' | 'shared' | 'broken' | 'recordStats' | 'keyScope'>;

const OPEN_ROUTES = new Set(['/healthz']);
/** the headers that name an episode, its group or its agent */
const ID_HEADERS = ['x-treepack-episode', 'x-treepack-group', 'x-treepack-agent'];

function sameSecret(a: string, b: string): boolean {
  const x = Buffer.from(a);
  const y = Buffer.from(b);
  return x.length === y.length && timingSafeEqual(x, y);
}

const make = (status: number, message: string, type: string, code: string | null = null) => ({
  status,
  body: { error: { message, type, code } },
});

/** The error type of a status the service answers itself. */
function errorType(status: number): string {
  if (status === 429) return 'rate_limit_error';
  if (status === 401 || status === 403) return 'authentication_error';
  if (status === 502 || status === 504) return 'engine_error';
  return status >= 500 ? 'server_error' : 'invalid_request_error';
}

/** Status and message of any error a route throws; the service keeps serving after each. */
function errorReply(
  err: unknown,
  bodyLimit: number,
): { status: number; body: { error: { message: string; type: string; code: string | null } } } {
  if (err instanceof PoolError) return make(err.status, err.message, errorType(err.status), err.code ?? null);
  if (err instanceof EngineError) return make(502, err.message, 'engine_error');
  if (err instanceof TreepackError)
    return make(err.code === 'E_ARG' || err.code === 'E_INPUT' ? 400 : 500, err.message, 'invalid_request_error', err.code);
  const fe = err as FastifyError;
  if (fe.code === 'FST_ERR_CTP_BODY_TOO_LARGE')
    return make(413, `request body larger than ${bodyLimit} bytes (the service's --body-limit)`, 'invalid_request_error', fe.code);
  if (typeof fe.statusCode === 'number' && fe.statusCode >= 400 && fe.statusCode < 500) {
    // Fastify's own refusals (malformed JSON, body too large, rate limit) keep their status and code.
    return make(fe.statusCode, fe.message, fe.statusCode === 429 ? 'rate_limit_error' : 'invalid_request_error', fe.code ?? null);
  }
  return make(500, (err as Error).message ?? String(err), 'server_error');
}

/** An error in the Anthropic Messages API's shape (for `/v1/messages`, whose clients read that one). */
function anthropicError(status: number, message: string): { type: 'error'; error: { type: string; message: string } } {
  const types: Record<number, string> = {
    400: 'invalid_request_error',
    401: 'authentication_error',
    403: 'permission_error',
    404: 'not_found_error',
    413: 'request_too_large',
    429: 'rate_limit_error',
  };
  return { type: 'error', error: { type: types[status] ?? (status >= 500 ? 'api_error' : 'invalid_request_error'), message } };
}

/**
 * Fastify's refusals before routing (a URL it cannot decode, a path parameter over its length) in the service's
 * error shape: the Fastify constructor's `frameworkErrors`.
 */
export function frameworkError(err: FastifyError, _req: FastifyRequest, reply: FastifyReply): void {
  const status = err.code === 'FST_ERR_MAX_PARAM_LENGTH' ? 414 : 400;
  const why =
    status === 414
      ? `a path parameter (episode or group id) is longer than ${MAX_ID_LENGTH} characters`
      : 'the URL is not valid percent-encoding';
  void reply.code(status).send(make(status, why, 'invalid_request_error', err.code).body);
}

export function registerHttp(app: FastifyInstance, svc: HttpCore): void {
  app.setErrorHandler((err, req: FastifyRequest, reply: FastifyReply) => {
    const { status, body } = errorReply(err, svc.opts.bodyLimit);
    if ((err as FastifyError).code === 'FST_ERR_CTP_INVALID_MEDIA_TYPE') {
      body.error.message = `header "content-type": the service reads JSON bodies (application/json), got ${JSON.stringify(req.headers['content-type'] ?? null)}`;
    }
    // The rate limiter's own Retry-After (the window's seconds left) stands; the pool's bound frees in seconds.
    if (status === 429 && !reply.hasHeader('retry-after')) reply.header('retry-after', '1');
    if (status !== 429 && status >= 400 && status < 500) svc.metrics.rejected.inc({ reason: `http_${status}` });
    const anthropic = (req.routeOptions.config as { errorShape?: string } | undefined)?.errorShape === 'anthropic';
    return reply.code(status).send(anthropic ? anthropicError(status, body.error.message) : body);
  });

  // Unknown routes, and URLs the router refuses (too long), answer in the service's own error shape.
  app.setNotFoundHandler((req, reply) => {
    svc.metrics.rejected.inc({ reason: 'http_404' });
    return reply
      .code(404)
      .send(make(404, `no route ${req.method} ${req.url.split('?')[0].slice(0, 200)}`, 'invalid_request_error', 'not_found').body);
  });

  // A scoped episode key opens its own episode's routes (SCOPED: calls, token counts, the model list, finish, abandon; each
  // route refuses another episode), nothing else, with or without --token.
  const token = svc.opts.token;
  app.addHook('onRequest', async (req) => {
    const path = req.url.split('?')[0];
    if (OPEN_ROUTES.has(path)) return;
    const got = bearer(req);
    if (token !== undefined && got !== undefined && sameSecret(got, token)) return;
    if (got !== undefined && (await svc.keyScope(got))) {
      if ((req.routeOptions.config as { scoped?: boolean } | undefined)?.scoped) return;
      throw new PoolError(
        403,
        `this API key opens its own episode's calls, token counts, model list, finish and abandon only, not ${req.method} ${path}`,
      );
    }
    if (token === undefined) return;
    if (got === undefined)
      throw new PoolError(
        401,
        'missing credentials: this service requires Authorization: Bearer <its --token, or a scoped API key from POST /v1/episodes>',
      );
    throw new PoolError(
      401,
      `wrong bearer token: neither this service's --token nor a scoped API key of ${svc.shared ? 'its shared pool' : 'this service'}`,
    );
  });

  // Every id a request names in its path or headers, checked once for every route (bodies' ids by their routes).
  app.addHook('onRequest', async (req) => {
    for (const [name, v] of Object.entries((req.params ?? {}) as Record<string, string>)) checkId(`path parameter "${name}"`, v);
    for (const h of ID_HEADERS) {
      const v = req.headers[h];
      if (v !== undefined) checkId(`header "${h}"`, Array.isArray(v) ? v.join(', ') : v);
    }
  });

  app.get('/healthz', async (_req, reply) => {
    // On the shared pool, a Redis this service is not connected to is an outage: finishes wait in the log and
    // steps cannot form or be handed out until it is back.
    const redis = svc.shared?.redis.status;
    const shared =
      svc.shared === undefined
        ? null
        : { url: svc.shared.url, connected: redis === 'ready', status: redis, last_error: svc.shared.lastError ?? null };
    const ok = !svc.broken && shared?.connected !== false;
    const body = {
      ok,
      broken: svc.broken ?? null,
      shared_pool: shared,
      trainer_version: svc.feed.version,
      pool_bytes: svc.pool.pendingBytes,
      pack_errors: svc.feed.errors.length,
    };
    return reply.code(ok ? 200 : 503).send(body);
  });

  app.get('/metrics', async (_req, reply) => {
    const text = await svc.metrics.registry.metrics();
    return reply.header('content-type', svc.metrics.registry.contentType).send(text);
  });

  app.get('/v1/batches/next', async (req, reply) => {
    const q = req.query as { rank?: string; dp?: string; wait?: string; client?: string };
    const rank = q.rank === undefined ? 0 : Number(q.rank);
    if (!Number.isInteger(rank) || rank < 0 || rank >= svc.opts.dp)
      throw new PoolError(
        400,
        `query parameter "rank": expected an integer in 0..${svc.opts.dp - 1} (dp = ${svc.opts.dp}), got ${JSON.stringify(q.rank)}`,
      );
    if (q.dp !== undefined && Number(q.dp) !== svc.opts.dp)
      throw new PoolError(400, `query parameter "dp": the service packs for dp = ${svc.opts.dp}, got ${JSON.stringify(q.dp)}`);
    const wait = q.wait === undefined ? 0 : Number(q.wait);
    if (!Number.isFinite(wait) || wait < 0 || wait > 300)
      throw new PoolError(400, `query parameter "wait": expected seconds in 0..300, got ${JSON.stringify(q.wait)}`);
    if (q.client !== undefined && !/^[\w.-]{1,128}$/.test(q.client))
      throw new PoolError(
        400,
        `query parameter "client": expected 1 to 128 letters, digits, '_', '.' or '-', got ${JSON.stringify(q.client)}`,
      );
    const h = await svc.feed.next(rank, wait * 1000, q.client);
    if (!h) return reply.code(204).header('retry-after', '1').send();
    return reply
      .header('content-type', 'application/octet-stream')
      .header('x-treepack-id', h.id)
      .header('x-treepack-entry', JSON.stringify(h.entry))
      .send(Buffer.from(h.bytes.buffer, h.bytes.byteOffset, h.bytes.byteLength));
  });

  app.post('/v1/batches/:id/ack', async (req) => {
    const { id } = req.params as { id: string };
    const r = await svc.feed.ack(id);
    return { id, step: r.step, step_done: r.stepDone, trainer_version: r.trainerVersion, repeated: r.repeated };
  });

  /** The producers are done with the groups numbered so far: those may form steps smaller than --groups-per-step. */
  app.post('/v1/feed/flush', async () => {
    const below = await svc.feed.flush();
    return { flushing: true, flush_below: below };
  });

  app.get('/v1/feed', async () => {
    const [d, q] = await Promise.all([svc.feed.depth(), svc.feed.quarantine()]);
    return {
      policy: svc.opts.policy,
      head: svc.feed.head,
      trainer_version: svc.feed.version,
      micro_batches_ready: d.ready,
      micro_batches_leased: d.leased,
      prompts: svc.recordStats,
      pack_errors: svc.feed.errors,
      quarantined: q.count,
      quarantine: q.latest,
    };
  });

  /** The episodes packed out of their steps (quarantine.ts), whole: their records reproduce the reason with `treepack pack`. */
  app.get('/v1/quarantine', async (req) => {
    const q = req.query as { limit?: string };
    const limit = q.limit === undefined ? 100 : Number(q.limit);
    if (!Number.isSafeInteger(limit) || limit < 1 || limit > QUARANTINE_LIST_MAX) {
      throw new PoolError(400, `query parameter "limit": expected an integer in 1..${QUARANTINE_LIST_MAX}, got ${JSON.stringify(q.limit)}`);
    }
    return { quarantined: await svc.feed.quarantined(limit) };
  });
}
