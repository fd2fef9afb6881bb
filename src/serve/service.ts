/**
 * `treepack serve` as a library: the recording core (recorder.ts) behind its HTTP routes, put together and
 * started. The routes call the core; the core knows nothing of them, so data flows one way: service → routes →
 * recorder → pool, feed and log.
 */
import Fastify, { type FastifyInstance } from 'fastify';
import rateLimit from '@fastify/rate-limit';
import { TreepackError } from '../errors.js';
import { registerBodyParser } from './body.js';
import type { TrainerFeed } from './feed.js';
import { registerGateway } from './gateway.js';
import { frameworkError, registerHttp } from './http.js';
import type { Metrics } from './metrics.js';
import type { ResolvedServiceOptions, ServiceOptions } from './options.js';
import { MAX_ID_LENGTH, type Pool } from './pool.js';
import { Recorder } from './recorder.js';
import type { RedisPool } from './redis-pool.js';
import { registerSlime } from './slime.js';
import type { ChatEncoder } from '../tokenize/chat.js';

export { resolveServiceOptions, sharedConfig, type ResolvedServiceOptions, type ServiceOptions } from './options.js';

/** `treepack serve` as a library: the recording core behind its HTTP routes (docs/reference/http.md). */
export class Service {
  readonly app: FastifyInstance;

  private constructor(readonly recorder: Recorder) {
    const { bodyLimit, requestTimeoutMs } = recorder.opts;
    this.app = Fastify({
      bodyLimit,
      logger: false,
      forceCloseConnections: true,
      frameworkErrors: frameworkError,
      // Fastify's default (100) made explicit: a longer path id is its 414, the same bound checkId holds ids to.
      routerOptions: { maxParamLength: MAX_ID_LENGTH },
      // A client has requestTimeoutMs for its headers and body, then gets 408 and its socket is closed; the wait
      // for the engine's answer is not counted (--engine-timeout bounds it). Node checks open requests on an
      // interval, so a slow sender is cut within the timeout and a quarter of it.
      requestTimeout: requestTimeoutMs,
      http: {
        headersTimeout: requestTimeoutMs,
        connectionsCheckingInterval: Math.max(50, Math.min(30_000, Math.floor(requestTimeoutMs / 4))),
      },
    });
  }

  get opts(): ResolvedServiceOptions {
    return this.recorder.opts;
  }
  get pool(): Pool {
    return this.recorder.pool;
  }
  get feed(): TrainerFeed {
    return this.recorder.feed;
  }
  /** the shared pool (--redis); undefined: the in-process pool */
  get shared(): RedisPool | undefined {
    return this.recorder.shared;
  }
  get metrics(): Metrics {
    return this.recorder.metrics;
  }
  get encoder(): ChatEncoder {
    return this.recorder.encoder;
  }

  /** Opens the recorder (replaying its log) and puts the routes in front of it; call `listen` to serve them. */
  static async create(options: ServiceOptions): Promise<Service> {
    const recorder = await Recorder.open(options);
    const svc = new Service(recorder);
    try {
      // A health probe is never limited: a limited one would report a healthy service down.
      if (recorder.opts.rateLimit > 0)
        await svc.app.register(rateLimit, {
          max: recorder.opts.rateLimit,
          timeWindow: 60_000,
          allowList: (req) => req.url.split('?')[0] === '/healthz',
        });
      registerBodyParser(svc.app);
      registerHttp(svc.app, recorder);
      registerGateway(svc.app, recorder);
      registerSlime(svc.app, recorder);
    } catch (err) {
      await svc.close();
      throw err;
    }
    return svc;
  }

  async listen(): Promise<string> {
    const { host, port } = this.opts;
    try {
      const url = await this.app.listen({ host, port });
      await this.recorder.checkEngine();
      return url;
    } catch (err) {
      const code = (err as NodeJS.ErrnoException).code;
      if (code === 'EADDRINUSE')
        throw new TreepackError('E_IO', `port ${port} on ${host} is in use (another service?): choose another with --port`);
      if (code === 'EADDRNOTAVAIL' || code === 'EACCES')
        throw new TreepackError('E_IO', `cannot listen on ${host}:${port} (${code}): check --host and --port`);
      throw err;
    }
  }

  async close(): Promise<void> {
    await this.app.close();
    await this.recorder.close();
  }
}

/** Creates a service (replaying its log) and starts listening; returns it and its URL. */
export async function startService(options: ServiceOptions): Promise<{ service: Service; url: string }> {
  const service = await Service.create(options);
  try {
    return { service, url: await service.listen() };
  } catch (err) {
    await service.close();
    throw err;
  }
}
