/**
 * The recording core of `treepack serve`: the pool, the durable log, the trainer feed and (with --redis) the
 * shared pool, put together. `Recorder.open` replays the log before it returns, so a restarted service answers as
 * the one that died would have. It knows nothing of HTTP: the routes (gateway.ts, http.ts, slime.ts) call it, and
 * service.ts puts it behind them.
 */
import { join } from 'node:path';
import { TreepackError } from '../errors.js';
import { ChatEncoder } from '../tokenize/chat.js';
import { resolveTokenizer } from '../tokenize/tokenizer.js';
import { Feed, type FeedOptions, type PackFn, type TrainerFeed } from './feed.js';
import { ImageStore } from './images.js';
import { DurableLog, type LogEvent } from './log.js';
import { runWorker } from './thread.js';
import { createMetrics, type Metrics } from './metrics.js';
import { resolveServiceOptions, sharedConfig, type ResolvedServiceOptions, type ServiceOptions } from './options.js';
import { countingPack, stepPacker, type StepPacker } from './packing.js';
import { engineModels } from './engine.js';
import { checkEvent, isFeedEvent, type ServiceEvent } from './events.js';
import { Pool, PoolError, type Episode, type Group, type PoolEvent, type RecordedCall, type Scope } from './pool.js';
import { quarantined, QuarantineFile, reportQuarantined, type Quarantined, type QuarantineEntry } from './quarantine.js';
import { emptyRecordStats } from './records.js';
import { RedisFeed } from './redis-feed.js';
import { RedisPool } from './redis-pool.js';
import type { RoutesDropped } from './routed-experts.js';
import { RoutesThread } from './routes-thread.js';

/** A finished episode's group in the shared pool: how many of its episodes are there, or not shipped yet. */
export type SharedGroup = { episodes: number } | { pending: true };

export class Recorder {
  readonly pool: Pool;
  feed!: TrainerFeed;
  /** the shared pool (--redis); undefined: the in-process pool */
  shared: RedisPool | undefined;
  readonly metrics: Metrics;
  readonly recordStats = emptyRecordStats();
  /** the recorded calls' images (images.ts): in the data directory, and the shared pool when there is one */
  images!: ImageStore;
  /** the reason writes stopped: a failed log write leaves memory ahead of the disk, so the service fails stopped */
  broken: string | undefined;
  private log!: DurableLog;
  private shipRetry: NodeJS.Timeout | undefined;
  private sweeper: NodeJS.Timeout | undefined;
  private sweeping = false;
  /** when this service started (after its replay): the idle timeout counts from it at most */
  private started = 0;
  /** when this gateway last told the shared pool of activity in a group */
  private touched = new Map<string, number>();
  /** episodes claimed in the shared pool before their first call is recorded (`openEpisode`) */
  private claimed = new Set<string>();
  /** the models the engine listed at start-up; undefined: it did not answer with a list (a warning said why) */
  engineModels: string[] | undefined;
  /** The start-up check of the engine, said by `checkEngine` once the service listens: a start-up failure stays one line. */
  private engineCheck: Promise<string[] | Error> = Promise.resolve([]);
  /** whether a call without token ids was warned about (once: the metric counts them) */
  private warnedUntokenized = false;
  /** the reasons routes were dropped for that were warned about (once each: the metric counts them) */
  private warnedRoutes = new Set<string>();
  /** checks the engine's routed experts off the event loop (started at the first routed output) */
  readonly routes = new RoutesThread();

  private constructor(
    readonly opts: ResolvedServiceOptions,
    readonly encoder: ChatEncoder,
    /** packs steps, in a worker thread where the packer options allow */
    readonly packer: StepPacker,
  ) {
    this.pool = new Pool({ groupSize: opts.groupSize });
    this.metrics = createMetrics(async () => {
      const d = this.pool.depth();
      // while the shared pool is unreachable its depths are unknown (NaN); the rest of /metrics still answers
      const f = await this.feed.depth().catch(() => ({ ready: NaN, leased: NaN }));
      const oldest = this.pool.oldestOpen();
      const oldestOpenGroupSeconds = oldest === undefined ? 0 : Math.max(0, Date.now() - oldest) / 1000;
      return {
        ...d,
        pendingBytes: this.pool.pendingBytes,
        microBatchesReady: f.ready,
        microBatchesLeased: f.leased,
        oldestOpenGroupSeconds,
      };
    });
  }

  static async open(options: ServiceOptions): Promise<Recorder> {
    const opts = resolveServiceOptions(options);
    // Checked while the tokenizers load: an engine URL that is wrong, or an engine that is down, is said at once.
    const models = engineModels(opts.engineUrl, opts.engineApiKey, Math.min(opts.engineTimeoutMs, 10_000)).catch((err: Error) => err);
    // The packing thread loads its tokenizer while this one does; both are ready before the routes open, so
    // neither load competes with traffic, and the first step packs at once.
    const encoder = resolveTokenizer(opts.packer.tokenizer).then((t) => new ChatEncoder(t));
    // One encoder here, shared by the in-thread packer when the options cannot go to a worker.
    const packer = stepPacker(opts.packer, () => encoder);
    let svc: Recorder;
    try {
      const ready = await encoder;
      await packer.ready();
      svc = new Recorder(opts, ready, packer);
    } catch (err) {
      await packer.close();
      throw err;
    }
    svc.engineCheck = models;
    try {
      await svc.start();
    } catch (err) {
      svc.metrics.close();
      await packer.close();
      throw err;
    }
    return svc;
  }

  /** Says what the start-up check found of the engine: its models, or a warning. */
  async checkEngine(): Promise<void> {
    const listed = await this.engineCheck;
    if (listed instanceof Error) this.warn(`${listed.message}; calls answer 502 until it does`);
    else this.engineModels = listed;
  }

  private async start(): Promise<void> {
    const opts = this.opts;
    const feedOpts: FeedOptions = { policy: opts.policy, groupsPerStep: opts.groupsPerStep, dp: opts.dp, leaseMs: opts.leaseMs };
    const warn = (m: string) => this.warn(m);
    const report = (entries: QuarantineEntry[]) => reportQuarantined(entries, this.metrics, warn);
    if (opts.redis) {
      this.shared = await RedisPool.connect(
        opts.redis,
        sharedConfig(opts),
        { allowWeak: opts.redisAllowWeakDurability === true, warn },
        opts.dataDir,
      );
      this.images = new ImageStore(opts.dataDir, this.shared);
      this.feed = await RedisFeed.open(this.shared, feedOpts, this.pack(), this.metrics, report);
    } else {
      this.images = new ImageStore(opts.dataDir);
      const dead = new QuarantineFile(join(opts.dataDir, 'quarantine.jsonl'));
      this.feed = new Feed(this.pool, feedOpts, this.pack(), (e) => this.append(e), this.metrics, dead, report);
    }
    try {
      const compaction = {
        rewrite: (path: string, upto: number, tmp: string) =>
          runWorker<number>('compact-worker', { path, upto, tmp, groupSize: opts.groupSize }),
        compactBytes: opts.compactBytes,
      };
      this.log = await DurableLog.open(join(opts.dataDir, 'events.jsonl'), (e, line, bytes) => this.replay(e, line, bytes), compaction);
      this.log.onWrite = (seconds) => this.metrics.logWrite.observe(seconds);
    } catch (err) {
      await this.feed.close();
      throw err;
    }
    // Finished before a crash and not known to be shipped: shipping again is harmless (the pool counts each once).
    if (this.shared) await this.shipUnshipped();
    this.started = Date.now();
    if (opts.idleTimeoutMs > 0) this.sweeper = setInterval(() => this.sweep(), Math.min(1000, opts.idleTimeoutMs / 4)).unref();
  }

  /**
   * The feed's packing: episodes with their images' bytes (recorded by reference) to the step packer; one whose
   * image is gone from the store is quarantined as a poison record is, the rest of its step packed.
   */
  private pack(): PackFn {
    const pack = countingPack(this.packer, this.metrics, this.recordStats);
    return async (episodes) => {
      const ready: Episode[] = [];
      const lost: Quarantined[] = [];
      for (const ep of episodes) {
        try {
          ready.push(await this.images.hydrate(ep));
        } catch (err) {
          if (!(err instanceof TreepackError && err.code === 'E_INPUT')) throw err; // I/O: the step is packed again later
          lost.push(quarantined(ep, err, undefined));
        }
      }
      const packed = await pack(ready);
      return { out: packed.out, quarantined: [...lost, ...packed.quarantined] };
    };
  }

  /** A warning for the operator: to `opts.warn`, else stderr. */
  private warn(message: string): void {
    if (this.opts.warn) this.opts.warn(message);
    else console.error(`treepack serve: warning: ${message}`);
  }

  /**
   * Counts a call the engine answered without token ids (one that ignores `return_token_ids`), and says so once: its
   * chat turns are then trained on the chat template's rendering of their text, not on the tokens the engine
   * sampled, and a completion without them is not trained.
   */
  private noteUntokenized(call: RecordedCall): void {
    if ([call.output, ...(call.siblings ?? [])].every((o) => o.promptTokenIds !== undefined && o.tokenIds !== undefined)) return;
    this.metrics.untokenized.inc({ kind: call.kind });
    if (this.warnedUntokenized) return;
    this.warnedUntokenized = true;
    this.warn(
      `the engine at ${this.opts.engineUrl} answered a ${call.kind} call without token ids (prompt_token_ids, choices[].token_ids; it was asked with return_token_ids: true): ` +
        'chat calls are then trained on the chat template rendering of their text, not on the tokens the engine sampled, and completions are not trained. ' +
        'Serve the policy with an engine that returns token ids (vLLM >= 0.10.2, SGLang); treepack_engine_untokenized_calls_total counts such calls',
    );
  }

  /**
   * Counts an output whose routes the engine returned and the gateway could not record (the call is recorded
   * without them, and trains without routing replay), and says so once per reason, naming the call and the field.
   */
  noteRoutesDropped(callId: string, dropped: RoutesDropped): void {
    this.metrics.routesDropped.inc({ reason: dropped.reason });
    if (this.warnedRoutes.has(dropped.reason)) return;
    this.warnedRoutes.add(dropped.reason);
    this.warn(
      `call ${callId}: the engine's routed experts were not recorded (${dropped.reason}): ${dropped.message}; ` +
        'the call is recorded without them. treepack_engine_routes_dropped_total counts such outputs',
    );
  }

  /** Abandons the groups idle for the idle timeout, one at a time. */
  private sweep(): void {
    if (this.sweeping || this.broken) return;
    const now = Date.now();
    // Bounded by the groups active lately.
    for (const [group, t] of this.touched) if (now - t >= this.opts.idleTimeoutMs) this.touched.delete(group);
    // Idle since this start at most: a service that was down does not give up, as it starts, the groups whose
    // agents waited for it.
    const idle = [...this.pool.open]
      .filter((g) => !g.closed && now - Math.max(g.active, this.started) >= this.opts.idleTimeoutMs)
      .map((g) => g.id);
    if (idle.length === 0) return;
    this.sweeping = true;
    void (async () => {
      for (const id of idle)
        await this.abandonGroup(id, `idle for ${this.opts.idleTimeoutMs / 1000} s`, this.opts.idleTimeoutMs).catch(() => {});
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

  private replay(raw: LogEvent, line: number, bytes: number): void {
    const file = join(this.opts.dataDir, 'events.jsonl');
    // A line that parses but is no event of this layout (damaged into other JSON, or written by another version)
    // is refused where it is, not skipped: skipping it would replay another state than the one clients were told.
    const e = checkEvent(raw, file, line);
    const unknown = this.unknownReference(e);
    if (unknown)
      throw new TreepackError('E_INPUT', `damaged log: a ${e.type} event of ${unknown}, which no line before it records`, {
        file,
        line,
        field: { abandon: 'group', take: 'groups' }[e.type as string] ?? 'episode',
      });
    if (e.type === 'snapshot') this.pool.apply(raw);
    else if (!isFeedEvent(e)) {
      try {
        return this.pool.apply(raw, bytes);
      } catch (err) {
        // a call continuing one the log does not hold: named with its line
        if (err instanceof TreepackError)
          throw new TreepackError(err.code, `damaged log: ${err.detail}`, { file, line, field: 'call.request.from' });
        throw err;
      }
    }
    if (this.feed instanceof Feed) return this.feed.apply(raw);
    if (e.type === 'snapshot' && e.steps === 0) return;
    throw new TreepackError(
      'E_ARG',
      'this log holds steps of the in-process trainer feed; a service on the shared pool (--redis) needs a --data directory of its own',
      { file, line },
    );
  }

  /** The episode or group an event acts on that the pool does not hold (then the log is damaged), else undefined. */
  private unknownReference(e: ServiceEvent): string | undefined {
    if ((e.type === 'finish' || e.type === 'ship') && !this.pool.episodes.has(e.episode)) return `episode ${JSON.stringify(e.episode)}`;
    if (e.type === 'abandon' && e.episode === undefined && !this.pool.groups.has(e.group)) return `group ${JSON.stringify(e.group)}`;
    if (e.type === 'take') {
      const seq = e.groups.find((g) => !Number.isSafeInteger(g) || g < 0 || g >= this.pool.bySeq.length);
      if (seq !== undefined) return `group number ${JSON.stringify(seq)}`;
    }
    return undefined;
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
    // in the shared pool before it is answered: the agent may be balanced to any gateway
    if (this.shared && e.type === 'key') await this.shared.addKey(e.hash, e.scope);
    if (this.shared && (e.type === 'call' || (e.type === 'abandon' && e.episode !== undefined))) {
      const group = this.pool.episodes.get(e.episode!)?.group ?? e.group ?? e.episode!;
      // A new episode is claimed in the shared pool (refused when another gateway records it), its group numbered.
      if (!this.pool.episodes.has(e.episode!) && !this.claimed.delete(e.episode!)) {
        await this.shared.openEpisode(group, e.episode!);
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
    if (e.type === 'call') this.noteUntokenized(e.call);
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
    await this.append(e);
    this.pool.apply(e);
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

  /**
   * Before a call's engine request: on the shared pool, claims an episode this gateway has not recorded yet, so a
   * call refused there (409 episode_on_another_gateway, 503 while Redis is unreachable) costs no generation.
   */
  async openEpisode(episode: string, group: string | undefined): Promise<void> {
    if (!this.shared || this.pool.episodes.has(episode) || this.claimed.has(episode)) return;
    await this.shared.openEpisode(group ?? episode, episode);
    // remembered until the call is recorded; forgetting a claim (the call failed) costs a second claim, no more
    if (this.claimed.size >= 10_000) this.claimed.clear();
    this.claimed.add(episode);
  }

  /**
   * The scope a scoped API key opens: minted here (the log), or on the shared pool by another gateway, which is
   * then kept here (in memory: the shared pool holds it) so the routes' later lookups find it.
   */
  async keyScope(key: string): Promise<Scope | undefined> {
    const local = this.pool.keyScope(key);
    if (local || !this.shared || !Pool.keyShaped(key)) return local;
    const hash = Pool.keyHash(key);
    const scope = await this.shared.keyScope(hash);
    if (scope) this.pool.apply({ type: 'key', hash, scope });
    return scope;
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
      throw new PoolError(
        429,
        `the rollout pool is full (${this.pool.pendingBytes} bytes waiting for the trainer, limit ${this.opts.maxPoolBytes}); retry later`,
      );
    }
  }

  async close(): Promise<void> {
    clearTimeout(this.shipRetry);
    clearInterval(this.sweeper);
    await this.feed.close();
    await this.log.close();
    await this.packer.close();
    await this.routes.close();
    this.metrics.close();
  }
}
