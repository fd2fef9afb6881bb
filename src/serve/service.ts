/**
 * `treepack serve` as a library: the pool, the durable log, the trainer feed and the HTTP app, put together and
 * started. `startService` replays the log before it listens, so a restarted service answers as the one that
 * died would have.
 */
import { join } from 'node:path';
import Fastify, { type FastifyInstance } from 'fastify';
import rateLimit from '@fastify/rate-limit';
import { argError, describeValue, TreepackError } from '../errors.js';
import type { PackerOptions } from '../packer/index.js';
import { resolveOptions as resolvePackerOptions } from '../packer/options.js';
import type { CollectorPolicy } from '../pack/schedule.js';
import { ChatEncoder } from '../tokenize/chat.js';
import { resolveTokenizer } from '../tokenize/tokenizer.js';
import { Feed, type FeedOptions, type TrainerFeed } from './feed.js';
import { registerGateway } from './gateway.js';
import { frameworkError, registerHttp } from './http.js';
import { DurableLog, type LogEvent } from './log.js';
import type { SnapshotEvent } from './compact.js';
import { runWorker } from './thread.js';
import { createMetrics, type Metrics } from './metrics.js';
import { countingPack, stepPacker, type StepPacker } from './packing.js';
import { Pool, PoolError, type Episode, type Group, type PoolEvent } from './pool.js';
import { emptyRecordStats } from './records.js';
import { RedisFeed } from './redis-feed.js';
import { RedisPool } from './redis-pool.js';
import { registerSlime } from './slime.js';

/** The options of `treepack serve` (docs/reference/cli.md), as the library takes them. */
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
  /**
   * redis://host:port/db of the shared pool for many services (gateways and trainer feeds): finished episodes go
   * there and the trainer feed is served from it. Absent: the in-process pool.
   */
  redis?: string;
  /**
   * start on a Redis whose settings may lose acknowledged writes on a crash (appendfsync not `always`), with a
   * warning; by default such a Redis is refused
   */
  redisAllowWeakDurability?: boolean;
  /** where warnings go; default: stderr */
  warn?: (message: string) => void;
  /** compact the durable log once it is this large and twice its size after the last compaction */
  compactBytes?: number;
  /**
   * a group with no call, finish or abandonment in any of its episodes for this long is abandoned: its unfinished
   * episodes are given up and it is trained with its finished ones (0: never). Default 30 minutes.
   */
  idleTimeoutMs?: number;
}

type OptionalKeys = 'engineApiKey' | 'token' | 'redis' | 'redisAllowWeakDurability' | 'warn';
export type ResolvedServiceOptions = Required<Omit<ServiceOptions, OptionalKeys>> & Pick<ServiceOptions, OptionalKeys>;

const LOOPBACK = new Set(['127.0.0.1', '::1', 'localhost']);
/** the trainer feed's own log events; the pool replays the rest */
const FEED_EVENTS = new Set(['take', 'handout', 'ack', 'flush']);
const LOG_EVENTS = new Set(['snapshot', 'key', 'call', 'finish', 'record', 'group-size', 'ship', 'abandon', ...FEED_EVENTS]);

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
    compactBytes: o.compactBytes ?? 64 << 20,
    idleTimeoutMs: o.idleTimeoutMs ?? 1_800_000,
    packer: withServeMerge(o.packer),
  };
  if (o.engineApiKey !== undefined) r.engineApiKey = o.engineApiKey;
  if (o.token !== undefined) r.token = o.token;
  if (o.redis !== undefined) {
    if (typeof o.redis !== 'string' || !/^rediss?:\/\//.test(o.redis)) throw argError('redis', 'a Redis URL, e.g. redis://127.0.0.1:6379', o.redis);
    r.redis = o.redis;
  }
  if (o.redisAllowWeakDurability !== undefined) {
    if (typeof o.redisAllowWeakDurability !== 'boolean') throw argError('redisAllowWeakDurability', 'true or false', o.redisAllowWeakDurability);
    if (r.redis === undefined) throw new TreepackError('E_ARG', 'redisAllowWeakDurability applies to the shared pool only: it needs redis');
    r.redisAllowWeakDurability = o.redisAllowWeakDurability;
  }
  if (o.warn !== undefined) {
    if (typeof o.warn !== 'function') throw argError('warn', 'a function taking the warning text', o.warn);
    r.warn = o.warn;
  }
  if (typeof r.dataDir !== 'string' || r.dataDir === '') throw argError('dataDir', 'a directory for the durable log', o.dataDir);
  if (!LOOPBACK.has(r.host) && !r.token) {
    if (r.token !== undefined) throw argError('token', 'a non-empty bearer token', r.token);
    throw new TreepackError('E_ARG', `a service bound to ${r.host}, not loopback, needs a bearer token (option token; --token T or TREEPACK_SERVE_TOKEN for the CLI): every request must authenticate`);
  }
  for (const k of ['groupSize', 'groupsPerStep', 'dp', 'leaseMs', 'engineTimeoutMs', 'maxPoolBytes', 'bodyLimit', 'compactBytes'] as const) {
    if (!Number.isSafeInteger(r[k]) || r[k] < 1) throw argError(k, 'an integer >= 1', r[k]);
  }
  if (!Number.isSafeInteger(r.idleTimeoutMs) || r.idleTimeoutMs < 0) throw argError('idleTimeoutMs', 'an integer >= 0 (0: never)', r.idleTimeoutMs);
  if (r.packer.budget?.dp !== undefined && r.packer.budget.dp !== r.dp) throw argError('dp', `the packer's budget.dp (${r.packer.budget.dp})`, r.dp);
  resolvePackerOptions(r.packer); // a bad packer option fails now, not at the first step
  if (r.dp > 1 && !r.packer.budget) throw argError('packer.budget', 'a token budget (maxTokens) when dp > 1: ranks come from the budgeted plan', r.packer.budget);
  return r;
}

/**
 * The service's packer options: as given, but timelines compare by token unless told otherwise (where `treepack
 * pack` compares by text): the gateway records the engine's own token ids, and two calls whose messages read the
 * same may not have been sent as the same tokens.
 */
function withServeMerge(p: PackerOptions | undefined): PackerOptions {
  if (p !== undefined && (p === null || typeof p !== 'object')) throw argError('packer', 'an object of packer options', p);
  const merge = p?.merge;
  if (merge === false || (merge !== undefined && (merge === null || typeof merge !== 'object'))) return p!; // off, or refused by resolvePackerOptions
  return { ...p, merge: { ...merge, timelineCompareLevel: merge?.timelineCompareLevel ?? 'token' } };
}

/**
 * The options every service on one shared pool must agree on: they decide which steps form and how they pack.
 * The packer's are compared resolved, with keys in one order, so a default given explicitly and one left out (or
 * the same options written in another order) agree. The tokenizer is not compared: its path may differ between
 * hosts holding the same files.
 */
export function sharedConfig(o: ResolvedServiceOptions): Record<string, unknown> {
  const p = resolvePackerOptions(o.packer);
  // layout: how the shared keys are laid out (2: the policy's state as `front` and `taken`, streams trimmed; 3: an
  // episode's calls written as what each adds to the one it continues; 4: abandoned episodes and groups, `done:`
  // and `act:` keys), so a pool left by a service of another layout is refused rather than misread
  return sortKeys({
    layout: 4,
    idleTimeoutMs: o.idleTimeoutMs,
    groupSize: o.groupSize,
    policy: o.policy,
    groupsPerStep: o.groupsPerStep,
    dp: o.dp,
    leaseMs: o.leaseMs,
    budget: p.budget ?? null,
    advantages: p.advantages,
    merge: p.merge,
    windowTokens: p.windowTokens,
    masks: p.masks,
    vocabSize: p.vocabSize ?? null,
  }) as Record<string, unknown>;
}

function sortKeys(v: unknown): unknown {
  if (Array.isArray(v)) return v.map(sortKeys);
  if (v === null || typeof v !== 'object') return v;
  const keys = Object.keys(v).sort();
  return Object.fromEntries(keys.map((k) => [k, sortKeys((v as Record<string, unknown>)[k])]));
}

/** A finished episode's group in the shared pool: how many of its episodes are there, or not shipped yet. */
export type SharedGroup = { episodes: number } | { pending: true };

/** `treepack serve` as a library: the pool, durable log, trainer feed and HTTP app (docs/reference/http.md). */
export class Service {
  readonly pool: Pool;
  feed!: TrainerFeed;
  /** the shared pool (--redis); undefined: the in-process pool */
  shared: RedisPool | undefined;
  readonly metrics: Metrics;
  readonly recordStats = emptyRecordStats();
  readonly app: FastifyInstance;
  /** the reason writes stopped: a failed log write leaves memory ahead of the disk, so the service fails stopped */
  broken: string | undefined;
  /** gateway calls in flight by episode and Idempotency-Key: a retry waits for the first attempt */
  readonly inflight = new Map<string, Promise<unknown>>();
  private log!: DurableLog;
  private shipRetry: NodeJS.Timeout | undefined;
  private sweeper: NodeJS.Timeout | undefined;
  private sweeping = false;
  /** when this service started (after its replay): the idle timeout counts from it at most */
  private started = 0;
  /** when this gateway last told the shared pool of activity in a group */
  private touched = new Map<string, number>();

  private constructor(
    readonly opts: ResolvedServiceOptions,
    readonly encoder: ChatEncoder,
    /** packs steps, in a worker thread where the packer options allow */
    readonly packer: StepPacker,
  ) {
    this.pool = new Pool({ groupSize: opts.groupSize });
    this.metrics = createMetrics(async () => {
      const d = this.pool.depth();
      const f = await this.feed.depth();
      const oldest = this.pool.oldestOpen();
      const oldestOpenGroupSeconds = oldest === undefined ? 0 : Math.max(0, Date.now() - oldest) / 1000;
      return { ...d, pendingBytes: this.pool.pendingBytes, microBatchesReady: f.ready, microBatchesLeased: f.leased, oldestOpenGroupSeconds };
    });
    this.app = Fastify({ bodyLimit: opts.bodyLimit, logger: false, forceCloseConnections: true, frameworkErrors: frameworkError });
  }

  static async create(options: ServiceOptions): Promise<Service> {
    const opts = resolveServiceOptions(options);
    // The packing thread loads its tokenizer while this one does; both are ready before the service listens, so
    // neither load competes with traffic, and the first step packs at once.
    const encoder = resolveTokenizer(opts.packer.tokenizer).then((t) => new ChatEncoder(t));
    // One encoder here, shared by the in-thread packer when the options cannot go to a worker.
    const packer = stepPacker(opts.packer, () => encoder);
    let svc: Service;
    try {
      const ready = await encoder;
      await packer.ready();
      svc = new Service(opts, ready, packer);
    } catch (err) {
      await packer.close();
      throw err;
    }
    try {
      await svc.start();
    } catch (err) {
      svc.metrics.close();
      await packer.close();
      throw err;
    }
    return svc;
  }

  private async start(): Promise<void> {
    const opts = this.opts;
    const feedOpts: FeedOptions = { policy: opts.policy, groupsPerStep: opts.groupsPerStep, dp: opts.dp, leaseMs: opts.leaseMs };
    const pack = countingPack(this.packer, this.metrics, this.recordStats);
    if (opts.redis) {
      const warn = opts.warn ?? ((m: string) => console.error(`treepack serve: warning: ${m}`));
      this.shared = await RedisPool.connect(opts.redis, sharedConfig(opts), { allowWeak: opts.redisAllowWeakDurability === true, warn });
      this.feed = await RedisFeed.open(this.shared, feedOpts, pack, this.metrics);
    } else this.feed = new Feed(this.pool, feedOpts, pack, (e) => this.append(e), this.metrics);
    try {
      const compaction = { rewrite: (path: string, upto: number, tmp: string) => runWorker<number>('compact-worker', { path, upto, tmp, groupSize: opts.groupSize }), compactBytes: opts.compactBytes };
      this.log = await DurableLog.open(join(opts.dataDir, 'events.jsonl'), (e, line, bytes) => this.replay(e, line, bytes), compaction);
      this.log.onWrite = (seconds) => this.metrics.logWrite.observe(seconds);
    } catch (err) {
      await this.feed.close();
      throw err;
    }
    // Finished before a crash and not known to be shipped: shipping again is harmless (the pool counts each once).
    if (this.shared) await this.shipUnshipped();
    // A health probe is never limited: a limited one would report a healthy service down.
    if (opts.rateLimit > 0) await this.app.register(rateLimit, { max: opts.rateLimit, timeWindow: 60_000, allowList: (req) => req.url.split('?')[0] === '/healthz' });
    registerHttp(this.app, this);
    registerGateway(this.app, this);
    registerSlime(this.app, this);
    this.started = Date.now();
    if (opts.idleTimeoutMs > 0) this.sweeper = setInterval(() => this.sweep(), Math.min(1000, opts.idleTimeoutMs / 4)).unref();
  }

  /** Abandons the groups idle for the idle timeout, one at a time. */
  private sweep(): void {
    if (this.sweeping || this.broken) return;
    const now = Date.now();
    for (const [group, t] of this.touched) if (now - t >= this.opts.idleTimeoutMs) this.touched.delete(group); // bounded by the groups active lately
    // Idle since this start at most: a service that was down does not give up, as it starts, the groups whose
    // agents waited for it.
    const idle = [...this.pool.open].filter((g) => !g.closed && now - Math.max(g.active, this.started) >= this.opts.idleTimeoutMs).map((g) => g.id);
    if (idle.length === 0) return;
    this.sweeping = true;
    void (async () => {
      for (const id of idle) await this.abandonGroup(id, `idle for ${this.opts.idleTimeoutMs / 1000} s`, this.opts.idleTimeoutMs).catch(() => {});
    })().finally(() => (this.sweeping = false));
  }

  /**
   * Abandons a group: its unfinished episodes are given up, it takes no new ones, and it goes to the trainer with
   * its finished episodes. On the shared pool it is closed there first, unless (`idleMs` > 0) an episode of it
   * was active through another gateway within `idleMs`.
   */
  async abandonGroup(id: string, reason: string, idleMs: number): Promise<Group> {
    const g = this.pool.groups.get(id);
    if (!g) throw new PoolError(404, `unknown group ${JSON.stringify(id)}: no episode of it was recorded here`);
    if (g.closed) return g;
    if (this.shared && !(await this.shared.closeGroup(id, idleMs))) return g;
    await this.commit({ type: 'abandon', group: id, reason, time: Date.now() });
    return g;
  }

  private replay(e: LogEvent, line: number, bytes: number): void {
    // A line that parses but is no event of this layout (damaged into other JSON, or written by a later version)
    // is refused where it is, not skipped: skipping it would replay another state than the one clients were told.
    if (typeof e !== 'object' || e === null || !LOG_EVENTS.has(e.type)) {
      throw new TreepackError('E_INPUT', `damaged log: expected an event with a "type" of ${[...LOG_EVENTS].join(', ')}, got ${describeValue(e)}`, { file: join(this.opts.dataDir, 'events.jsonl'), line, field: 'type' });
    }
    if (e.type === 'snapshot') this.pool.apply(e);
    else if (!FEED_EVENTS.has(e.type)) {
      try {
        return this.pool.apply(e, bytes);
      } catch (err) {
        // a call continuing one the log does not hold: named with its line
        if (err instanceof TreepackError) throw new TreepackError(err.code, `damaged log: ${err.detail}`, { file: join(this.opts.dataDir, 'events.jsonl'), line, field: 'call.request.from' });
        throw err;
      }
    }
    if (this.feed instanceof Feed) return this.feed.apply(e);
    if (e.type === 'snapshot' && (e as unknown as SnapshotEvent).steps === 0) return;
    throw new TreepackError('E_ARG', 'this log holds steps of the in-process trainer feed; a service on the shared pool (--redis) needs a --data directory of its own', { file: join(this.opts.dataDir, 'events.jsonl'), line });
  }

  private append(e: LogEvent): Promise<void> {
    return this.appendLine(DurableLog.line(e));
  }

  private appendLine(line: Buffer): Promise<void> {
    if (this.broken) return Promise.reject(new PoolError(503, `the service stopped writing: ${this.broken}`));
    return this.log.appendLine(line).catch((err: Error) => {
      this.broken = `log write failed: ${err.message}`;
      throw new PoolError(503, this.broken);
    });
  }

  /**
   * Checks, applies and logs a pool event; resolves once it is durable. On the shared pool a new group gets its
   * submission number there first, and a finished episode is shipped there before the answer (or, when Redis
   * does not answer, later: it is safe in the log).
   */
  async commit(e: PoolEvent): Promise<SharedGroup | undefined> {
    this.pool.check(e);
    if (this.shared && e.type === 'call') {
      const group = this.pool.episodes.get(e.episode)?.group ?? e.group ?? e.episode;
      if (!this.pool.groups.has(group)) {
        await this.shared.groupSeq(group);
        this.pool.check(e); // the episode may have finished meanwhile
      }
      this.touch(group);
    }
    // A call is logged as what it adds to the episode's previous one; its line, serialized once, is also what the
    // pool counts toward its bound.
    const logged = (e.type === 'call' ? this.pool.logged(e) : e) as unknown as LogEvent;
    const line = DurableLog.line(logged);
    const durable = this.appendLine(line);
    this.pool.apply(logged, line.length);
    await durable;
    if (!this.shared || (e.type !== 'finish' && e.type !== 'record' && e.type !== 'abandon')) return undefined;
    if (e.type === 'abandon' && e.episode === undefined) {
      // closed in the shared pool already: its abandoned episodes are refused there, which the log notes
      void this.shipUnshipped().catch(() => this.shipLater());
      return undefined;
    }
    try {
      return await this.ship(this.pool.episodes.get(e.episode!)!);
    } catch (err) {
      if (err instanceof PoolError) throw err;
      this.shipLater();
      return { pending: true };
    }
  }

  /** Hands a finished episode to the shared pool, then frees it here; a refusal is logged as shipped too. */
  private async ship(ep: Episode): Promise<SharedGroup> {
    let refused: PoolError | undefined;
    let r: SharedGroup | undefined;
    try {
      r = await this.shared!.ship(ep, this.pool.groups.get(ep.group)!.size);
    } catch (err) {
      if (!(err instanceof PoolError)) throw err;
      refused = err;
    }
    const e: PoolEvent = { type: 'ship', episode: ep.id };
    await this.append(e as unknown as LogEvent);
    this.pool.apply(e as unknown as LogEvent);
    if (refused) throw refused;
    return r!;
  }

  private async shipUnshipped(): Promise<void> {
    for (const ep of this.pool.unshipped()) {
      await this.ship(ep).catch((err: unknown) => {
        if (!(err instanceof PoolError)) throw err; // refusals are logged; anything else stops the start
      });
    }
  }

  /** Tells the shared pool of activity in a group, at most four times per idle timeout. */
  private touch(group: string): void {
    const now = Date.now();
    if (this.opts.idleTimeoutMs === 0 || now - (this.touched.get(group) ?? 0) < this.opts.idleTimeoutMs / 4) return;
    this.touched.set(group, now);
    this.shared!.touch(group).catch(() => this.touched.delete(group));
  }

  private shipLater(): void {
    this.shipRetry ??= setTimeout(() => {
      this.shipRetry = undefined;
      this.shipUnshipped().catch(() => this.shipLater());
    }, 1000).unref();
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
    try {
      return await this.app.listen({ host: this.opts.host, port: this.opts.port });
    } catch (err) {
      const code = (err as NodeJS.ErrnoException).code;
      if (code === 'EADDRINUSE') throw new TreepackError('E_IO', `port ${this.opts.port} on ${this.opts.host} is in use (another service?): choose another with --port`);
      if (code === 'EADDRNOTAVAIL' || code === 'EACCES') throw new TreepackError('E_IO', `cannot listen on ${this.opts.host}:${this.opts.port} (${code}): check --host and --port`);
      throw err;
    }
  }

  async close(): Promise<void> {
    clearTimeout(this.shipRetry);
    clearInterval(this.sweeper);
    await this.app.close();
    await this.feed.close();
    await this.log.close();
    await this.packer.close();
    this.metrics.close();
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
