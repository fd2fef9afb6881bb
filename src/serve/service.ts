/**
 * `treepack serve` as a library: the pool, the durable log, the trainer feed and the HTTP app, put together and
 * started. `startService` replays the log before it listens, so a restarted service answers as the one that
 * died would have.
 */
import { join } from 'node:path';
import Fastify, { type FastifyInstance } from 'fastify';
import rateLimit from '@fastify/rate-limit';
import { argError } from '../errors.js';
import type { PackerOptions } from '../packer/index.js';
import { resolveOptions as resolvePackerOptions } from '../packer/options.js';
import type { CollectorPolicy } from '../pack/schedule.js';
import { ChatEncoder } from '../tokenize/chat.js';
import { loadTokenizer } from '../tokenize/tokenizer.js';
import { Feed } from './feed.js';
import { registerGateway } from './gateway.js';
import { registerHttp } from './http.js';
import { DurableLog, type LogEvent } from './log.js';
import { createMetrics, type Metrics } from './metrics.js';
import { stepPacker } from './packing.js';
import { Pool, PoolError, type PoolEvent } from './pool.js';
import { emptyRecordStats } from './records.js';
import { registerSlime } from './slime.js';

export interface ServiceOptions {
  /** the engine's OpenAI base URL, e.g. http://127.0.0.1:8000/v1 */
  engineUrl: string;
  engineApiKey?: string;
  engineTimeoutMs?: number;
  /** directory of the durable log */
  dataDir: string;
  host?: string;
  port?: number;
  /** required when host is not a loopback address */
  token?: string;
  groupSize?: number;
  policy?: CollectorPolicy;
  groupsPerStep?: number;
  dp?: number;
  leaseMs?: number;
  packer?: PackerOptions;
  /** refuse new calls with 429 once this many bytes of recorded calls wait for consumption */
  maxPoolBytes?: number;
  bodyLimit?: number;
  /** requests per minute per client address; 0: no limit */
  rateLimit?: number;
}

export type ResolvedServiceOptions = Required<Omit<ServiceOptions, 'engineApiKey' | 'token' | 'packer'>> & Pick<ServiceOptions, 'engineApiKey' | 'token' | 'packer'>;

const LOOPBACK = new Set(['127.0.0.1', '::1', 'localhost']);

export function resolveServiceOptions(o: ServiceOptions): ResolvedServiceOptions {
  if (typeof o.engineUrl !== 'string' || !/^https?:\/\//.test(o.engineUrl)) throw argError('engineUrl', 'an http(s) URL of the engine, e.g. http://127.0.0.1:8000/v1', o.engineUrl);
  const r: ResolvedServiceOptions = {
    engineUrl: o.engineUrl.replace(/\/+$/, ''),
    engineTimeoutMs: o.engineTimeoutMs ?? 600_000,
    dataDir: o.dataDir,
    host: o.host ?? '127.0.0.1',
    port: o.port ?? 8400,
    groupSize: o.groupSize ?? 1,
    policy: o.policy ?? { kind: 'windowed-fifo', window: 4 },
    groupsPerStep: o.groupsPerStep ?? 1,
    dp: o.dp ?? o.packer?.budget?.dp ?? 1,
    leaseMs: o.leaseMs ?? 600_000,
    maxPoolBytes: o.maxPoolBytes ?? 1 << 30,
    bodyLimit: o.bodyLimit ?? 32 << 20,
    rateLimit: o.rateLimit ?? 0,
  };
  if (o.engineApiKey !== undefined) r.engineApiKey = o.engineApiKey;
  if (o.token !== undefined) r.token = o.token;
  if (o.packer !== undefined) r.packer = o.packer;
  if (typeof r.dataDir !== 'string' || r.dataDir === '') throw argError('dataDir', 'a directory for the durable log', o.dataDir);
  if (!LOOPBACK.has(r.host) && !r.token) throw argError('token', `a bearer token: the service is bound to ${r.host}, not loopback, so every request must authenticate`, r.token);
  for (const k of ['groupSize', 'groupsPerStep', 'dp', 'leaseMs', 'engineTimeoutMs', 'maxPoolBytes', 'bodyLimit'] as const) {
    if (!Number.isSafeInteger(r[k]) || r[k] < 1) throw argError(k, 'an integer >= 1', r[k]);
  }
  if (r.packer?.budget?.dp !== undefined && r.packer.budget.dp !== r.dp) throw argError('dp', `the packer's budget.dp (${r.packer.budget.dp})`, r.dp);
  resolvePackerOptions(r.packer); // a bad packer option fails now, not at the first step
  if (r.dp > 1 && !r.packer?.budget) throw argError('packer.budget', 'a token budget (maxTokens) when dp > 1: ranks come from the budgeted plan', r.packer?.budget);
  return r;
}

export class Service {
  readonly pool: Pool;
  readonly feed: Feed;
  readonly metrics: Metrics;
  readonly recordStats = emptyRecordStats();
  readonly app: FastifyInstance;
  /** the reason writes stopped: a failed log write leaves memory ahead of the disk, so the service fails stopped */
  broken: string | undefined;
  private log!: DurableLog;

  private constructor(
    readonly opts: ResolvedServiceOptions,
    readonly encoder: ChatEncoder,
  ) {
    this.pool = new Pool({ groupSize: opts.groupSize });
    this.metrics = createMetrics(() => {
      const d = this.pool.depth();
      const f = this.feed.depth();
      return { ...d, pendingBytes: this.pool.pendingBytes, microBatchesReady: f.ready, microBatchesLeased: f.leased };
    });
    this.feed = new Feed(this.pool, { policy: opts.policy, groupsPerStep: opts.groupsPerStep, dp: opts.dp, leaseMs: opts.leaseMs }, stepPacker(encoder, opts.packer ?? {}, this.metrics, this.recordStats), (e) => this.append(e), this.metrics);
    this.app = Fastify({ bodyLimit: opts.bodyLimit, logger: false, forceCloseConnections: true });
  }

  static async create(options: ServiceOptions): Promise<Service> {
    const opts = resolveServiceOptions(options);
    const encoder = new ChatEncoder(await loadTokenizer(opts.packer?.tokenizer));
    const svc = new Service(opts, encoder);
    svc.log = await DurableLog.open(join(opts.dataDir, 'events.jsonl'), (e) => svc.replay(e));
    if (opts.rateLimit > 0) await svc.app.register(rateLimit, { max: opts.rateLimit, timeWindow: 60_000 });
    registerHttp(svc.app, svc);
    registerGateway(svc.app, svc);
    registerSlime(svc.app, svc);
    return svc;
  }

  private replay(e: LogEvent): void {
    if (e.type === 'take' || e.type === 'ack') this.feed.apply(e);
    else this.pool.apply(e);
  }

  private append(e: LogEvent): Promise<void> {
    if (this.broken) return Promise.reject(new PoolError(503, `the service stopped writing: ${this.broken}`));
    return this.log.append(e).catch((err: Error) => {
      this.broken = `log write failed: ${err.message}`;
      throw new PoolError(503, this.broken);
    });
  }

  /** Checks, applies and logs a pool event; resolves once it is durable. */
  async commit(e: PoolEvent): Promise<void> {
    this.pool.check(e);
    const durable = this.append(e as unknown as LogEvent);
    this.pool.apply(e as unknown as LogEvent);
    await durable;
  }

  /** Backpressure: refuses new calls while the pool holds more than its bound. */
  admit(): void {
    if (this.broken) throw new PoolError(503, `the service stopped writing: ${this.broken}`);
    if (this.pool.pendingBytes > this.opts.maxPoolBytes) {
      this.metrics.rejected.inc({ reason: 'pool_full' });
      throw new PoolError(429, `the rollout pool is full (${this.pool.pendingBytes} bytes waiting for the trainer, limit ${this.opts.maxPoolBytes}); retry later`);
    }
  }

  async listen(): Promise<string> {
    return this.app.listen({ host: this.opts.host, port: this.opts.port });
  }

  async close(): Promise<void> {
    await this.app.close();
    await this.log.close();
  }
}

export async function startService(options: ServiceOptions): Promise<{ service: Service; url: string }> {
  const service = await Service.create(options);
  const url = await service.listen();
  return { service, url };
}
