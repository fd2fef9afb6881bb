/**
 * The service's options: what `treepack serve` and `startService` take, checked and defaulted, and the part every
 * service on one shared pool must agree on.
 */
import { argError, TreepackError } from '../errors.js';
import type { PackerOptions } from '../packer/index.js';
import { resolveOptions as resolvePackerOptions } from '../packer/options.js';
import type { CollectorPolicy } from '../pack/schedule.js';

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
  /** the largest group size a finish (`group_size`) or slime's `num_repeat_per_sample` may set. Default 1024. */
  maxGroupSize?: number;
  /**
   * how long a client may take to send a request's headers and body, in ms (not the engine's answer: a long
   * generation is never cut); a slower client gets 408 and its socket is closed. Default 60 s.
   */
  requestTimeoutMs?: number;
  /**
   * ask the engine for the experts it routed each token to (`return_routed_experts: true`, which SGLang needs;
   * vLLM returns them whenever it runs with --enable-return-routed-experts). Routes an engine returns are recorded
   * either way. Default false.
   */
  recordRoutes?: boolean;
  /** [layers, experts per token] of the routes an engine sends as a flat array (SGLang) */
  routeShape?: readonly [layers: number, topK: number];
  /** the most bytes (as int16) one output's routes may take; larger ones are not recorded. Default 64 MiB. */
  maxRouteBytes?: number;
  /**
   * the most bytes (decoded from base64) a chat call's images may take together; a call over it is answered 413.
   * Default 16 MiB.
   */
  maxImageBytes?: number;
}

type OptionalKeys = 'engineApiKey' | 'token' | 'redis' | 'redisAllowWeakDurability' | 'warn' | 'routeShape';
export type ResolvedServiceOptions = Required<Omit<ServiceOptions, OptionalKeys>> & Pick<ServiceOptions, OptionalKeys>;

const LOOPBACK = new Set(['127.0.0.1', '::1', 'localhost']);

export function resolveServiceOptions(o: ServiceOptions): ResolvedServiceOptions {
  if (typeof o.engineUrl !== 'string' || !/^https?:\/\//.test(o.engineUrl))
    throw argError('engineUrl', 'an http(s) URL of the engine, e.g. http://127.0.0.1:8000/v1', o.engineUrl);
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
    maxGroupSize: o.maxGroupSize ?? 1024,
    requestTimeoutMs: o.requestTimeoutMs ?? 60_000,
    recordRoutes: o.recordRoutes ?? false,
    maxRouteBytes: o.maxRouteBytes ?? 64 << 20,
    maxImageBytes: o.maxImageBytes ?? 16 << 20,
    packer: withServeMerge(o.packer),
  };
  if (o.engineApiKey !== undefined) r.engineApiKey = o.engineApiKey;
  if (o.token !== undefined) r.token = o.token;
  if (o.redis !== undefined) {
    if (typeof o.redis !== 'string' || !/^rediss?:\/\//.test(o.redis))
      throw argError('redis', 'a Redis URL, e.g. redis://127.0.0.1:6379', o.redis);
    r.redis = o.redis;
  }
  if (o.redisAllowWeakDurability !== undefined) {
    if (typeof o.redisAllowWeakDurability !== 'boolean')
      throw argError('redisAllowWeakDurability', 'true or false', o.redisAllowWeakDurability);
    if (r.redis === undefined) throw new TreepackError('E_ARG', 'redisAllowWeakDurability applies to the shared pool only: it needs redis');
    r.redisAllowWeakDurability = o.redisAllowWeakDurability;
  }
  if (typeof r.recordRoutes !== 'boolean') throw argError('recordRoutes', 'true or false', r.recordRoutes);
  if (o.routeShape !== undefined) {
    const s = o.routeShape as unknown;
    if (!Array.isArray(s) || s.length !== 2 || !s.every((x) => Number.isSafeInteger(x) && (x as number) >= 1 && (x as number) <= 0xffff))
      throw argError('routeShape', '[layers, experts per token], two integers in 1..65535', s);
    r.routeShape = [s[0] as number, s[1] as number];
  }
  if (o.warn !== undefined) {
    if (typeof o.warn !== 'function') throw argError('warn', 'a function taking the warning text', o.warn);
    r.warn = o.warn;
  }
  if (typeof r.dataDir !== 'string' || r.dataDir === '') throw argError('dataDir', 'a directory for the durable log', o.dataDir);
  if (!LOOPBACK.has(r.host) && !r.token) {
    if (r.token !== undefined) throw argError('token', 'a non-empty bearer token', r.token);
    throw new TreepackError(
      'E_ARG',
      `a service bound to ${r.host}, not loopback, needs a bearer token (option token; --token T or TREEPACK_SERVE_TOKEN for the CLI): every request must authenticate`,
    );
  }
  for (const k of [
    'groupSize',
    'groupsPerStep',
    'dp',
    'leaseMs',
    'engineTimeoutMs',
    'maxPoolBytes',
    'bodyLimit',
    'compactBytes',
    'maxGroupSize',
    'requestTimeoutMs',
    'maxRouteBytes',
    'maxImageBytes',
  ] as const) {
    if (!Number.isSafeInteger(r[k]) || r[k] < 1) throw argError(k, 'an integer >= 1', r[k]);
  }
  if (r.groupSize > r.maxGroupSize) throw argError('groupSize', `an integer <= maxGroupSize (${r.maxGroupSize})`, r.groupSize);
  if (!Number.isSafeInteger(r.idleTimeoutMs) || r.idleTimeoutMs < 0)
    throw argError('idleTimeoutMs', 'an integer >= 0 (0: never)', r.idleTimeoutMs);
  if (r.packer.budget?.dp !== undefined && r.packer.budget.dp !== r.dp)
    throw argError('dp', `the packer's budget.dp (${r.packer.budget.dp})`, r.dp);
  resolvePackerOptions(r.packer); // a bad packer option fails now, not at the first step
  // Redis Streams hand a rank's expired micro-batches out before its new ones, one at a time: a step plan's order
  // (each micro-batch after the one that pushed its prefix) would not survive a trainer's restart.
  if (r.redis !== undefined && r.packer.budget?.prefixCacheTokens !== undefined) {
    throw new TreepackError(
      'E_ARG',
      "step plans (packer budget.prefixCacheTokens, --prefix-reuse) are served by one service, not through a shared Redis pool: the Redis feed does not keep a plan's order when a micro-batch is handed out again",
      { field: 'redis' },
    );
  }
  // The feed hands each micro-batch to the one rank its entry names: a context-parallel group's other ranks would get none.
  if ((r.packer.budget?.cp ?? 1) !== 1)
    throw argError('packer.budget.cp', '1: the feed hands a micro-batch to one rank, not to a context-parallel group', r.packer.budget?.cp);
  if (r.dp > 1 && !r.packer.budget)
    throw argError('packer.budget', 'a token budget (maxTokens) when dp > 1: ranks come from the budgeted plan', r.packer.budget);
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
  // and `act:` keys; 5: episodes claimed by their gateway (`ep:`), slime's rounds (`rnd:`, `rid:`, `res:`)), so a
  // pool left by a service of another layout is refused rather than misread
  return sortKeys({
    layout: 5,
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
    routeConflict: p.routeConflict,
    vocabSize: p.vocabSize ?? null,
  }) as Record<string, unknown>;
}

function sortKeys(v: unknown): unknown {
  if (Array.isArray(v)) return v.map(sortKeys);
  if (v === null || typeof v !== 'object') return v;
  const keys = Object.keys(v).sort();
  return Object.fromEntries(keys.map((k) => [k, sortKeys((v as Record<string, unknown>)[k])]));
}
