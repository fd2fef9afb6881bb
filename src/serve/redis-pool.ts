/**
 * The shared rollout pool on Redis, for many gateways and trainer ranks (`treepack serve --redis URL`). Each
 * gateway still records calls in its own durable log; a finished episode is then shipped here, whichever gateway
 * recorded it, and its group is finished when `size` of its episodes have arrived from any of them. A finished
 * group is XADDed to the `groups` stream, which every service tails to mirror the scheduling policy's input
 * (redis-feed.ts forms steps from it).
 *
 * Every script is idempotent, because a request whose reply an outage swallowed is retried (by the client, after
 * its 503) and a restarted gateway ships again what it cannot prove was shipped: an episode counts once (HSETNX),
 * and a group already consumed ignores late arrivals (its `gone:` marker).
 *
 * An episode's calls are all recorded by one gateway, the first to see it (`ep:` names it): each call is logged as
 * what it adds to the one it continues, which only that gateway's log holds; a call or finish reaching another
 * gateway is refused (409 episode_on_another_gateway) rather than recorded apart and lost.
 *
 * Keys (all under `treepack:`; one deployment per Redis database): `nseq` groups numbered so far; `seq` group →
 * submission number; `eps:{group}` episode → JSON (abandoned episodes too: they count toward the group's size and
 * are not trained); `order:{group}` episodes in arrival order; `done:{group}` complete (its episodes arrived, or
 * it was closed: abandoned); `act:{group}` its last activity (ms); `gone:{group}` consumed (these three expire
 * after a week); `res:{group}` the episodes that took its places (shipped, or slime records placed there);
 * `ep:{episode}` the gateway recording it; `rnd:{instance}` a slime instance's latest round, `rid:{instance}` its
 * records' uids → digest and group (these expire after a week); `groups` stream of finished groups; `config` the
 * feed options every service must share; `keys` scoped API keys' SHA-256 → scope JSON (a key minted by any gateway
 * opens its episode on every one; like the log's `key` events, they do not expire); `image:{sha256}` a recorded
 * image's bytes (images.ts: the episodes name them; they do not expire).
 */
import { randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { hostname } from 'node:os';
import { join } from 'node:path';
import { Redis, ReplyError } from 'ioredis';
import { TreepackError } from '../errors.js';
import { writeFileAtomic } from '../io/atomic.js';
import { continuing, expanded, PoolError, type Episode, type RecordedCall, type Scope } from './pool.js';

/** The error code of a request refused because the shared pool does not answer (HTTP 503). */
export const SHARED_POOL_UNAVAILABLE = 'shared_pool_unavailable';
/** The error code of a call or finish for an episode another gateway records (HTTP 409). */
export const EPISODE_ON_ANOTHER_GATEWAY = 'episode_on_another_gateway';
/**
 * How long a command may wait for Redis's answer. Commands are not queued while Redis is unreachable, nor resent
 * after a reconnect (they fail at once): a request fails within this bound rather than waiting out the outage.
 */
export const COMMAND_TIMEOUT_MS = 10_000;

export const PREFIX = 'treepack:';
/** how long a consumed group refuses late episodes */
export const GONE_TTL_S = 7 * 24 * 3600;

/**
 * Lua helpers: a group's submission number, assigned on first sight (-1 once the group is consumed); its last
 * activity (Redis's clock, so gateways' clocks need not agree); its completion, once (`done:`), which puts it in the
 * `groups` stream.
 */
const SEQ_OF = `
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function touch(p, g)
  redis.call('SET', p .. 'act:' .. g, now_ms(), 'EX', ${GONE_TTL_S})
end
local function complete(p, g, seq)
  redis.call('SET', p .. 'done:' .. g, 1, 'EX', ${GONE_TTL_S})
  redis.call('XADD', p .. 'groups', '*', 'group', g, 'seq', seq)
end
local function reserve(p, g, e)
  redis.call('SADD', p .. 'res:' .. g, e)
  redis.call('EXPIRE', p .. 'res:' .. g, ${GONE_TTL_S})
end
local function seq_of(p, g)
  if redis.call('EXISTS', p .. 'gone:' .. g) == 1 then return -1 end
  local s = redis.call('HGET', p .. 'seq', g)
  if s then return tonumber(s) end
  s = redis.call('INCR', p .. 'nseq') - 1
  redis.call('HSET', p .. 'seq', g, s)
  return s
end
`;

const SCRIPTS = {
  /**
   * ARGV: prefix, group, episode, gateway → {the group's submission number, ''}; {-1, ''} when the group was
   * consumed; {-4, gateway} when another gateway records the episode. The first gateway to see an episode records
   * all of it (its log holds the calls each later call continues); the claim goes with the group's records.
   */
  tpOpen:
    SEQ_OF +
    `
local p, g, e, me = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local k = p .. 'ep:' .. e
local owner = redis.call('GET', k)
if owner and owner ~= me then return {-4, owner} end
local seq = seq_of(p, g)
if seq < 0 then return {-1, ''} end
if not owner then redis.call('SET', k, me, 'EX', ${GONE_TTL_S}) end
return {seq, ''}
`,
  /**
   * ARGV: prefix, instance, uid, group size, the record's digest → {group, status}: the group (round) a slime
   * record joins, status 1. A uid written before (a resend, through any gateway) gets the group it joined, status
   * 1, or 0 once that group was consumed, or -2 when it came with another record. A new uid joins the instance's
   * latest round while that is neither complete, consumed nor holding `size` episodes, else the next round (its
   * key: the instance, U+0000, its number; round 0's key is the instance).
   */
  tpRound:
    SEQ_OF +
    `
local p, name, uid, size, digest = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local ids = p .. 'rid:' .. name
redis.call('EXPIRE', ids, ${GONE_TTL_S})
local had = redis.call('HGET', ids, uid)
if had then
  local d, g = string.match(had, '^(%S+) (.*)$')
  if d ~= digest then return {g, -2} end
  if redis.call('EXISTS', p .. 'gone:' .. g) == 1 then return {g, 0} end
  return {g, 1}
end
local r = tonumber(redis.call('GET', p .. 'rnd:' .. name) or '0')
local g
while true do
  g = r == 0 and name or (name .. '\\0' .. r)
  if redis.call('EXISTS', p .. 'gone:' .. g) == 0 and redis.call('EXISTS', p .. 'done:' .. g) == 0 and redis.call('SCARD', p .. 'res:' .. g) < size then break end
  r = r + 1
end
redis.call('SET', p .. 'rnd:' .. name, r, 'EX', ${GONE_TTL_S})
reserve(p, g, uid)
redis.call('HSET', ids, uid, digest .. ' ' .. g)
touch(p, g)
return {g, 1}
`,
  /**
   * ARGV: prefix, group, episode, episode JSON, group size → {seq, episodes in the group, status}; status 1: added,
   * 0: already there (a resend), -1: the group was consumed, -2: the group already had its `size` episodes.
   */
  tpShip:
    SEQ_OF +
    `
local p, g, e, size = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[5])
local seq = seq_of(p, g)
if seq < 0 then return {seq, 0, -1} end
local eps = p .. 'eps:' .. g
if redis.call('HEXISTS', eps, e) == 1 then return {seq, redis.call('HLEN', eps), 0} end
local n = redis.call('HLEN', eps)
if n >= size or redis.call('EXISTS', p .. 'done:' .. g) == 1 then return {seq, n, -2} end
redis.call('HSET', eps, e, ARGV[4])
redis.call('RPUSH', p .. 'order:' .. g, e)
reserve(p, g, e)
touch(p, g)
n = n + 1
if n == size then complete(p, g, seq) end
return {seq, n, 1}
`,
  /**
   * ARGV: prefix, group, idle ms → 1: closed now (a finished group, with the episodes it has), 0: it was complete
   * already, -1: consumed, -3: not idle (an episode of it was active through some gateway within idle ms; 0: close
   * regardless).
   */
  tpClose:
    SEQ_OF +
    `
local p, g, idle = ARGV[1], ARGV[2], tonumber(ARGV[3])
if redis.call('EXISTS', p .. 'gone:' .. g) == 1 then return -1 end
if redis.call('EXISTS', p .. 'done:' .. g) == 1 then return 0 end
local act = redis.call('GET', p .. 'act:' .. g)
if idle > 0 and act and now_ms() - tonumber(act) < idle then return -3 end
complete(p, g, seq_of(p, g))
return 1
`,
  /** ARGV: prefix, group → notes an episode of the group active now (what the idle timeout measures) */
  tpTouch: SEQ_OF + `touch(ARGV[1], ARGV[2]) return 1`,
  /** ARGV: prefix, config JSON → the config every service shares (set by the first one) */
  tpConfig: `
redis.call('SET', ARGV[1] .. 'config', ARGV[2], 'NX')
return redis.call('GET', ARGV[1] .. 'config')
`,
} as const;

export interface DurabilityOptions {
  /** start on a Redis that may lose acknowledged writes, with a warning (`--redis-allow-weak-durability`) */
  allowWeak: boolean;
  warn: (message: string) => void;
}

/**
 * The no-loss guarantee holds only when Redis appends every write to its append-only file and fsyncs it before
 * answering (`appendonly yes`, `appendfsync always`): otherwise a Redis crash forgets acknowledgements and
 * published steps the services were told about. A server that says otherwise is refused unless allowed; one
 * that will not say (CONFIG renamed away or denied by its ACL, as managed Redis services do) is a warning.
 */
async function checkDurability(redis: Redis, url: string, o: DurabilityOptions): Promise<void> {
  let settings: string[];
  try {
    settings = [...(await redis.config('GET', 'appendonly')), ...(await redis.config('GET', 'appendfsync'))];
  } catch (err) {
    const why = (err as Error).message;
    if (!/unknown command|NOPERM|no permissions/i.test(why))
      throw new TreepackError('E_IO', `the shared pool at ${url} did not answer CONFIG GET: ${why}`);
    o.warn(
      `cannot check that the shared pool at ${url} keeps what it acknowledges (CONFIG GET refused: ${why}); it must run with appendonly yes and appendfsync always, or a Redis crash may lose acknowledged work`,
    );
    return;
  }
  const value = (name: string) => (settings.includes(name) ? settings[settings.indexOf(name) + 1] : undefined);
  const weak = Object.entries({ appendonly: 'yes', appendfsync: 'always' })
    .filter(([name, want]) => value(name) !== want)
    .map(([name, want]) => `${name} is ${JSON.stringify(value(name) ?? null)}, not ${want}`);
  if (weak.length === 0) return;
  const message = `the shared pool at ${url} may lose what it acknowledges on a crash: ${weak.join(', ')}. Start Redis with --appendonly yes --appendfsync always (or CONFIG SET appendonly yes, CONFIG SET appendfsync always, then CONFIG REWRITE)`;
  if (!o.allowWeak)
    throw new TreepackError('E_ARG', `${message}; --redis-allow-weak-durability starts anyway, without the no-loss guarantee`);
  o.warn(`${message}; starting anyway (--redis-allow-weak-durability): a Redis crash may lose acknowledged work`);
}

/**
 * An episode as it travels through Redis: its set of agents becomes a list, and each call is what it adds to the
 * one it continues (as in the log).
 */
export function episodeJson(ep: Episode): string {
  const { requests: _byRequest, ...rest } = ep; // rebuilt from the calls' request ids where needed
  // a call's answer kept for retries stays with its gateway: the pool's consumers never read it
  const calls = ep.calls.map((c, i) => {
    const { answer: _answer, ...logged } = continuing(ep.calls, i, c);
    return logged;
  });
  return JSON.stringify({ ...rest, agents: [...ep.agents], calls });
}

export function episodeFromJson(s: string): Episode {
  const o = JSON.parse(s) as Episode & { agents: string[] };
  const calls: RecordedCall[] = [];
  for (const c of o.calls) calls.push(expanded(calls, c, o.id));
  return { ...o, agents: new Set(o.agents), calls };
}

/**
 * This gateway's name in the shared pool, kept in its data directory so a restarted gateway is the same one: the
 * host and directory (to say where an episode is recorded) and a random part (hosts may share a path).
 */
function gatewayIdentity(dataDir: string): string {
  const file = join(dataDir, 'gateway-id');
  try {
    return readFileSync(file, 'utf8').trim();
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'ENOENT') throw err;
  }
  const id = `${hostname()}:${dataDir}#${randomBytes(6).toString('base64url')}`;
  writeFileAtomic(file, id + '\n');
  return id;
}

export class RedisPool {
  /** the client's last connection error, if any */
  lastError: string | undefined;
  private identity: string | undefined;

  private constructor(
    readonly url: string,
    readonly redis: Redis,
    /** the gateway's data directory, which holds its name in the shared pool */
    private readonly dataDir: string,
  ) {}

  /**
   * A failure to reach Redis (down, restarting, not answering within COMMAND_TIMEOUT_MS) as the 503 the client
   * gets; Redis's own refusals (a script's error) and the pool's stay as they are.
   */
  unavailable(err: unknown): unknown {
    if (err instanceof PoolError || err instanceof TreepackError || err instanceof ReplyError) return err;
    return new PoolError(
      503,
      `the shared pool at ${this.url} is unreachable (${(err as Error).message}); retry once GET /healthz answers 200`,
      SHARED_POOL_UNAVAILABLE,
    );
  }

  /** Runs a request on Redis, failing as `unavailable` says. */
  async guard<T>(p: Promise<T>): Promise<T> {
    try {
      return await p;
    } catch (err) {
      throw this.unavailable(err);
    }
  }

  /**
   * Connects (failing with the URL when Redis does not answer), checks that Redis keeps what it acknowledges
   * (see `checkDurability`) and the feed options against the others'.
   */
  static async connect(url: string, config: Record<string, unknown>, durability: DurabilityOptions, dataDir: string): Promise<RedisPool> {
    // RESP2: the stream replies keep the shapes Redis documents (XREAD: [[stream, entries]]) on any server. While
    // Redis is unreachable the client reconnects in the background and every command fails at once (no offline
    // queue, no resend): requests answer 503 for the outage instead of waiting it out.
    const redis = new Redis(url, {
      lazyConnect: true,
      connectTimeout: 5000,
      protocol: 2,
      enableOfflineQueue: false,
      maxRetriesPerRequest: 0,
      commandTimeout: COMMAND_TIMEOUT_MS,
    });
    const pool = new RedisPool(url, redis, dataDir);
    redis.on('error', (err: Error) => (pool.lastError = err.message));
    try {
      await redis.connect();
    } catch (err) {
      redis.disconnect();
      throw new TreepackError(
        'E_IO',
        `the shared pool at ${url} is unreachable: ${(err as Error).message} (start one: redis-server --port 6379 --appendonly yes --appendfsync always)`,
      );
    }
    try {
      await checkDurability(redis, url, durability);
    } catch (err) {
      redis.disconnect();
      throw err;
    }
    pool.define(SCRIPTS);
    const want = JSON.stringify(config);
    const have = (await pool.script('tpConfig', want)) as string;
    if (have !== want) {
      redis.disconnect();
      throw new TreepackError(
        'E_ARG',
        `the shared pool at ${url} serves other feed options: ${have}; this service has ${want}. Every service on one pool must be started with the same options`,
      );
    }
    return pool;
  }

  /**
   * Registers Lua scripts (run by EVALSHA, loaded again after a Redis restart). Scripts take no KEYS: they
   * derive group keys from their arguments, so the pool needs one Redis, not a Redis Cluster.
   */
  define(scripts: Record<string, string>): void {
    for (const [name, lua] of Object.entries(scripts)) this.redis.defineCommand(name, { numberOfKeys: 0, lua });
  }

  /** Runs a script defined here with the key prefix as its first argument. */
  script(name: string, ...args: (string | number | Buffer)[]): Promise<unknown> {
    return (this.redis as unknown as Record<string, (...a: unknown[]) => Promise<unknown>>)[name](PREFIX, ...args);
  }

  /**
   * Opens an episode on this gateway: claims it (every call of an episode goes through one gateway) and numbers
   * its group (windowed FIFO's order) when any gateway first sees it. Refused (409) when another gateway records
   * the episode or its group was consumed.
   */
  async openEpisode(group: string, episode: string): Promise<void> {
    this.identity ??= gatewayIdentity(this.dataDir);
    const [seq, owner] = (await this.guard(this.script('tpOpen', group, episode, this.identity))) as [number, string];
    if (seq === -4)
      throw new PoolError(
        409,
        `episode ${JSON.stringify(episode)} is recorded by another gateway (${owner}): every call and the finish of an episode go to the gateway of its first call`,
        EPISODE_ON_ANOTHER_GATEWAY,
      );
    if (seq < 0) throw new PoolError(409, `group ${JSON.stringify(group)} was already consumed`);
  }

  /**
   * The group (round) a slime record joins, chosen over every gateway's records (tpRound); undefined for a resend
   * of a record whose group was consumed already (it was read). The same uid with another record is a 409.
   */
  async recordGroup(instance: string, uid: string, size: number, digest: string): Promise<string | undefined> {
    const [group, status] = (await this.guard(this.script('tpRound', instance, uid, size, digest))) as [string, number];
    if (status === -2) throw new PoolError(409, `uid ${JSON.stringify(uid)} was already written, with another record`);
    return status === 1 ? group : undefined;
  }

  /**
   * Adds a finished episode to its group; a refusal (the group consumed, or full from other gateways) is a
   * PoolError after the fact: the episode is recorded in this gateway's log but will not be trained.
   */
  async ship(ep: Episode, size: number): Promise<{ seq: number; episodes: number }> {
    const [seq, episodes, status] = (await this.script('tpShip', ep.group, ep.id, episodeJson(ep), size)) as number[];
    if (status === -1)
      throw new PoolError(
        409,
        `group ${JSON.stringify(ep.group)} was already consumed by the trainer; episode ${JSON.stringify(ep.id)} is recorded but not trained`,
      );
    if (status === -2)
      throw new PoolError(
        409,
        `group ${JSON.stringify(ep.group)} already has its ${size} episodes in the shared pool; episode ${JSON.stringify(ep.id)} is recorded but not trained`,
      );
    return { seq: seq, episodes: episodes };
  }

  /**
   * Closes a group (abandoned): finished with the episodes it has. False when an episode of it was active within
   * `idleMs` through any gateway (0: closed regardless); a consumed group is a 409.
   */
  async closeGroup(group: string, idleMs: number): Promise<boolean> {
    const status = Number(await this.guard(this.script('tpClose', group, idleMs)));
    if (status === -1) throw new PoolError(409, `group ${JSON.stringify(group)} was already consumed`);
    return status !== -3;
  }

  /** Notes activity in a group, which its idle timeout measures on every gateway. */
  async touch(group: string): Promise<void> {
    await this.script('tpTouch', group);
  }

  /** Makes a scoped key (by its SHA-256) valid on every gateway of the pool. */
  async addKey(hash: string, scope: Scope): Promise<void> {
    await this.guard(this.redis.hset(`${PREFIX}keys`, hash, JSON.stringify(scope)));
  }

  /** Stores a recorded image's bytes by their sha256, once (images.ts). */
  async putImage(sha: string, bytes: Buffer): Promise<void> {
    await this.guard(this.redis.set(`${PREFIX}image:${sha}`, bytes, 'NX'));
  }

  /** A recorded image's bytes by their sha256, or undefined. */
  async getImage(sha: string): Promise<Buffer | undefined> {
    return (await this.guard(this.redis.getBuffer(`${PREFIX}image:${sha}`))) ?? undefined;
  }

  /** The scope of a key minted by any gateway of the pool (by its SHA-256), or undefined. */
  async keyScope(hash: string): Promise<Scope | undefined> {
    const json = await this.guard(this.redis.hget(`${PREFIX}keys`, hash));
    if (json === null) return undefined;
    const scope = JSON.parse(json) as Scope;
    if (typeof scope?.episode !== 'string')
      throw new TreepackError('E_INPUT', `the shared pool at ${this.url} holds a damaged scoped key: ${json.slice(0, 200)}`);
    return scope;
  }

  /** A finished group's episodes, in arrival order. */
  async groupEpisodes(group: string): Promise<Episode[]> {
    const ids = await this.redis.lrange(`${PREFIX}order:${group}`, 0, -1);
    if (ids.length === 0) return [];
    const json = await this.redis.hmget(`${PREFIX}eps:${group}`, ...ids);
    return json.map((s, i) => {
      if (s === null)
        throw new TreepackError('E_INPUT', `the shared pool lost episode ${JSON.stringify(ids[i])} of group ${JSON.stringify(group)}`);
      return episodeFromJson(s);
    });
  }

  async close(): Promise<void> {
    await this.redis.quit().catch(() => this.redis.disconnect());
  }
}
