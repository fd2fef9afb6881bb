/**
 * The rollout pool: episodes, their recorded calls and their groups, rebuilt from the durable log's events by
 * the same `apply` that handles them live, so a replayed service is in exactly the state its clients were told.
 *
 * Groups are numbered in submission order (the first time any of their episodes is seen); a group is finished
 * when `groupSize` of its episodes are. Which finished groups go to a consumer, and when, is the scheduler's job
 * (Collector in src/pack/schedule.ts); the pool only says which groups are finished and holds their records.
 */
import { createHash, randomBytes } from 'node:crypto';
import { TreepackError } from '../errors.js';
import type { CallKind, EngineOutput } from './engine.js';
import type { LogEvent } from './log.js';

export interface CallRequest {
  messages?: unknown[];
  tools?: unknown[];
  prompt?: string;
}

/**
 * A chat request as the log holds it when it shares a prefix with an earlier call of its episode (`Pool.logged`):
 * the messages after the first `keep` of call `from`, and that call's tools where `sameTools`. An agent re-sends
 * its whole context on every call, so logging each call whole would make the log (and the pool) grow with the
 * square of an episode's length.
 */
export interface LoggedRequest extends CallRequest {
  from?: string;
  keep?: number;
  sameTools?: true;
}

export interface RecordedCall {
  id: string;
  kind: CallKind;
  agent?: string;
  /** the client's Idempotency-Key header */
  requestId?: string;
  /** with requestId: the SHA-256 of the request body (recordDigest), so a key reused for another body is refused */
  requestDigest?: string;
  /** with requestId: the answer's body as the client got it (an SSE stream whole), so a retry gets it byte for byte */
  answer?: { text: string; sse?: true };
  time: number;
  policyVersion: number;
  request: CallRequest;
  /** the answer (choice 0 where the client asked for n > 1) */
  output: EngineOutput;
  /** choices 1..n-1 of a call with n > 1: the same prompt, each its own branch */
  siblings?: EngineOutput[];
}

export interface Episode {
  id: string;
  group: string;
  agents: Set<string>;
  calls: RecordedCall[];
  finished: boolean;
  reward?: number;
  metadata?: Record<string, unknown>;
  /** slime record written directly (buffer/write): the record as given */
  direct?: Record<string, unknown>;
  /** the SHA-256 of that record's JSON (kept once the record is freed): a resent write is answered, not refused */
  written?: string;
  bytes: number;
  /** handed to the shared pool (Redis mode): its records live there now, not here */
  shipped?: boolean;
  /**
   * why it was given up (explicitly, by a finish without a call, or by the idle timeout): never trained, it counts
   * toward its group
   */
  abandoned?: string;
  /** its calls by the client's Idempotency-Key: a retried call is answered from its record */
  requests?: Map<string, RecordedCall>;
}

export interface Group {
  id: string;
  seq: number; // submission order
  size: number;
  episodes: string[];
  finished: number;
  /** episodes abandoned: with the finished ones they complete the group */
  abandoned: number;
  /** abandoned as a whole: complete with the episodes it has, takes no new ones */
  closed: boolean;
  /** handed to the scheduler (finished + abandoned reached its size, or closed) */
  complete: boolean;
  /** ms time of its first and of its latest event (call, finish, abandon): what the idle timeout measures */
  started: number;
  active: number;
  consumed: boolean;
}

export interface Scope {
  episode: string;
  agent?: string;
  group?: string;
}

export interface PoolOptions {
  /** Episodes per group (GRPO's n); a group is finished when this many of its episodes are. */
  groupSize: number;
}

/**
 * `key` events hold the key's SHA-256 (`hash`); logs written before that hold the key itself (`key`), hashed as
 * they are replayed.
 */
export type PoolEvent =
  | { type: 'key'; hash: string; scope: Scope; time?: number; key?: undefined }
  | { type: 'call'; episode: string; group?: string; call: RecordedCall }
  | { type: 'finish'; episode: string; reward: number; metadata?: Record<string, unknown>; group_size?: number; time: number }
  | { type: 'record'; episode: string; group: string; record: Record<string, unknown>; reward: number; time: number }
  | { type: 'group-size'; size: number }
  | { type: 'ship'; episode: string }
  /**
   * gives up an episode (`episode`: it is created in `group` when no call was recorded under it) or a whole group
   * (`episode` absent: its unfinished episodes are abandoned and it takes no new ones)
   */
  | { type: 'abandon'; group: string; episode?: string; reason: string; time: number };

/** The log event that stands for the events a compaction folded (compact.ts writes it, the pool restores it). */
export interface SnapshotEvent {
  type: 'snapshot';
  /** the last `group-size` event's size, when there was one */
  groupSize?: number;
  /** groups numbered below it may form smaller steps (a flush); absent in snapshots older than the bound */
  flushBelow?: number;
  /** a snapshot written before flushes had a bound: flushed (then: every group it holds) */
  flushing?: boolean;
  /** steps formed so far: those not replayed after the snapshot are done */
  steps: number;
  /** trainer version from the steps done */
  version: number;
  /** the pool's counters less what the live events add again */
  counters: Pool['counters'];
  /** scoped keys in clear: snapshots written before keys were hashed */
  keys?: [string, Scope][];
  /** scoped keys by their SHA-256 */
  keyHashes?: [string, Scope][];
  /** every group, in submission order */
  groups: [id: string, size: number, consumed: 0 | 1][];
  /** episodes whose records are gone (consumed or shipped): group number, finished, shipped, reward, abandoned */
  dead: [id: string, seq: number, finished: 0 | 1, shipped: 0 | 1, reward: number | null, abandoned?: 0 | 1][];
}

/** A request the pool refuses: HTTP status and a message naming the field. */
export class PoolError extends Error {
  constructor(
    readonly status: number,
    message: string,
    /** a stable code for the failures a client handles by kind (the error body's `code`) */
    readonly code?: string,
  ) {
    super(message);
  }
}

/**
 * slime's producer writes every instance (`instance_id`) again each epoch, with new uids, and its buffer groups a
 * record with those of its instance not yet read. The pool's groups have a fixed size, so a record whose
 * instance's group cannot take it (complete, abandoned or full) starts the instance's next round: a group of its
 * own, keyed by the instance and the round's number joined by this character, which no episode or group id may
 * hold. Round 0's key is the instance itself.
 */
export const ROUND_SEP = '\u0000';

export function roundKey(instance: string, round: number): string {
  return round === 0 ? instance : `${instance}${ROUND_SEP}${round}`;
}

/** A group's name as its clients gave it: a round's instance. */
export function groupName(key: string): string {
  const i = key.indexOf(ROUND_SEP);
  return i < 0 ? key : key.slice(0, i);
}

/** The longest id a client may choose (episode, group, agent): as long as a path parameter may be. */
export const MAX_ID_LENGTH = 100;

/**
 * The one check of an id a client chose, from a path, a header or a body (400, naming where it came from): at most
 * MAX_ID_LENGTH characters, not blank, no control characters (which include the round separator: they would make
 * logs, metrics and the records' ids ambiguous).
 */
export function checkId(field: string, id: string): string {
  const shown = id.length > 40 ? `${JSON.stringify(id.slice(0, 40))}...` : JSON.stringify(id);
  if (id.length > MAX_ID_LENGTH)
    throw new PoolError(400, `${field} ${shown}: an id is at most ${MAX_ID_LENGTH} characters, got ${id.length}`);
  if (id.trim() === '') throw new PoolError(400, `${field} ${shown}: an id may not be empty or blank`);
  if (/\p{Cc}/u.test(id))
    throw new PoolError(400, `${field} ${shown}: an id may not hold control characters (U+0000 to U+001F, U+007F to U+009F)`);
  return id;
}

const ID_PREFIX = randomBytes(12).toString('base64url') + '-';
let idCounter = 0;

export class Pool {
  readonly episodes = new Map<string, Episode>();
  readonly groups = new Map<string, Group>();
  /** groups by submission number */
  readonly bySeq: Group[] = [];
  /** scoped API keys by their SHA-256 (the log never holds a key itself) */
  readonly keys = new Map<string, Scope>();
  /** scoped keys' scopes by episode: the group of an episode opened by a key and abandoned before its first call */
  readonly keyed = new Map<string, Scope>();
  /** the latest round of each slime instance that has more than one (see ROUND_SEP) */
  readonly rounds = new Map<string, number>();
  /** groups neither complete nor consumed: what the idle timeout watches */
  readonly open = new Set<Group>();
  groupSize: number;
  /** bytes of recorded data held for groups not yet consumed */
  pendingBytes = 0;
  counters = { calls: 0, episodesFinished: 0, groupsFinished: 0 };
  private openEpisodes = 0;
  private waitingGroups = 0;
  /** called with a group's submission number when it becomes finished */
  onGroupFinished: (seq: number) => void = () => {};

  constructor(opts: PoolOptions) {
    this.groupSize = opts.groupSize;
  }

  /** A secret: a scoped API key authenticates its episode's calls, so it must not be guessable. */
  static newKey(): string {
    return 'tp-' + randomBytes(18).toString('base64url');
  }

  /** Whether `key` has the shape `newKey` gives (worth looking up in the shared pool). */
  static keyShaped(key: string): boolean {
    return /^tp-[\w-]{24}$/.test(key);
  }

  /** What the log and the pool keep of a scoped key: its SHA-256, hex. */
  static keyHash(key: string): string {
    return createHash('sha256').update(key).digest('hex');
  }

  /** The scope a key opens, or undefined when it is no scoped key. */
  keyScope(key: string): Scope | undefined {
    return this.keys.get(Pool.keyHash(key));
  }

  /**
   * A unique id that needs no randomness of its own (a call id is made on every call): this process's random
   * prefix, new at every start and different on every gateway, and a counter.
   */
  static newId(): string {
    return ID_PREFIX + (idCounter++).toString(36);
  }

  /** Checks an event before it is logged; throws PoolError. Events that pass always apply. */
  check(e: PoolEvent): void {
    switch (e.type) {
      case 'call':
        return this.checkCall(e.episode, e.group);
      case 'finish': {
        const ep = this.episodes.get(e.episode);
        if (!ep) throw new PoolError(404, `unknown episode ${JSON.stringify(e.episode)}: no call was recorded under it`);
        if (ep.abandoned)
          throw new PoolError(409, `episode ${JSON.stringify(e.episode)} was abandoned (${ep.abandoned}); its reward is not taken`);
        if (ep.finished) throw new PoolError(409, `episode ${JSON.stringify(e.episode)} is already finished`);
        return;
      }
      case 'abandon': {
        if (e.episode === undefined) {
          if (!this.groups.has(e.group))
            throw new PoolError(404, `unknown group ${JSON.stringify(e.group)}: no episode of it was recorded`);
          return this.checkGroupOpen(e.group, undefined, true);
        }
        const ep = this.episodes.get(e.episode);
        if (ep?.finished) throw new PoolError(409, `episode ${JSON.stringify(e.episode)} is already finished`);
        if (!ep) this.checkCall(e.episode, e.group);
        return;
      }
      case 'record': {
        if (this.episodes.has(e.episode)) throw new PoolError(409, `uid ${JSON.stringify(e.episode)} was already written`);
        this.checkGroupOpen(e.group, undefined);
        return;
      }
      default:
        return;
    }
  }

  /**
   * The group a slime record of `instance` joins: the instance's latest round, or its next one when that round
   * cannot take another episode (complete, abandoned, consumed or full), as slime's buffer starts the instance
   * afresh once its group is read.
   */
  recordGroup(instance: string): string {
    for (let round = this.rounds.get(instance) ?? 0; ; round++) {
      const key = roundKey(instance, round);
      const g = this.groups.get(key);
      if (!g || !(g.complete || g.closed || g.consumed || g.episodes.length >= g.size)) return key;
    }
  }

  /** Whether a call may be recorded under this episode (checked before the engine is called, and again after). */
  checkCall(episode: string, group: string | undefined): void {
    const ep = this.episodes.get(episode);
    if (!ep) {
      checkId('episode', episode);
      if (group !== undefined && !this.groups.has(group)) checkId('group', group);
    }
    if (ep?.abandoned) throw new PoolError(409, `episode ${JSON.stringify(episode)} was abandoned; a new call needs a new episode id`);
    if (ep?.finished) throw new PoolError(409, `episode ${JSON.stringify(episode)} is finished; a new call needs a new episode id`);
    if (ep && group !== undefined && group !== ep.group)
      throw new PoolError(
        409,
        `episode ${JSON.stringify(episode)} belongs to group ${JSON.stringify(ep.group)}, not ${JSON.stringify(group)}`,
      );
    this.checkGroupOpen(group ?? episode, ep);
  }

  private checkGroupOpen(group: string, ep: Episode | undefined, whole = false): void {
    const g = this.groups.get(group);
    if (g?.consumed) throw new PoolError(409, `group ${JSON.stringify(group)} was already consumed`);
    if (g?.closed && !(whole || ep)) throw new PoolError(409, `group ${JSON.stringify(group)} was abandoned; it takes no new episodes`);
    if (g && !ep && !whole && g.episodes.length >= g.size)
      throw new PoolError(409, `group ${JSON.stringify(group)} already has its ${g.size} episodes`);
  }

  /**
   * Applies a checked event. `bytes`, its line's size in the log, is what a call or record counts toward
   * `pendingBytes` until its group is consumed (the bound that answers 429); the compactor, which bounds nothing,
   * leaves it 0.
   */
  apply(ev: LogEvent, bytes = 0): void {
    if (ev.type === 'snapshot') return this.restore(ev as unknown as SnapshotEvent);
    const e = ev as unknown as PoolEvent;
    switch (e.type) {
      case 'key':
        this.keys.set(e.hash ?? Pool.keyHash(e.key!), e.scope);
        this.keyed.set(e.scope.episode, e.scope);
        return;
      case 'group-size':
        this.groupSize = e.size;
        return;
      case 'call': {
        const ep = this.episode(e.episode, e.group ?? e.episode, e.call.time);
        if (e.call.agent !== undefined) ep.agents.add(e.call.agent);
        const call = expanded(ep.calls, e.call, ep.id);
        ep.calls.push(call);
        if (call.requestId !== undefined) (ep.requests ??= new Map()).set(call.requestId, call);
        ep.bytes += bytes;
        this.pendingBytes += bytes;
        this.counters.calls++;
        return;
      }
      case 'record': {
        const ep = this.episode(e.episode, e.group, e.time);
        ep.direct = e.record;
        ep.written = recordDigest(e.record);
        ep.bytes = bytes;
        this.pendingBytes += bytes;
        this.finishEpisode(ep, e.reward, undefined, undefined);
        return;
      }
      case 'finish': {
        const ep = this.episodes.get(e.episode)!;
        this.groups.get(ep.group)!.active = e.time;
        this.finishEpisode(ep, e.reward, e.metadata, e.group_size);
        return;
      }
      case 'abandon': {
        let g: Group;
        if (e.episode !== undefined) {
          const ep = this.episode(e.episode, e.group, e.time);
          if (!ep.abandoned) this.abandonEpisode(ep, e.reason);
          g = this.groups.get(ep.group)!;
        } else {
          g = this.groups.get(e.group)!;
          g.closed = true;
          for (const id of g.episodes) {
            const ep = this.episodes.get(id)!;
            if (!ep.finished && !ep.abandoned) this.abandonEpisode(ep, e.reason);
          }
        }
        g.active = e.time;
        this.maybeComplete(g);
        return;
      }
      case 'ship': {
        const ep = this.episodes.get(e.episode)!;
        ep.shipped = true;
        this.free(ep);
        return;
      }
    }
  }

  /** A call event as the log holds it: the call as `continuing` the episode's calls writes it. */
  logged(e: PoolEvent & { type: 'call' }): PoolEvent {
    const calls = this.episodes.get(e.episode)?.calls;
    return calls ? { ...e, call: continuing(calls, calls.length, e.call) } : e;
  }

  /** A compacted log's first event: groups, and what is left of episodes whose records are gone. */
  private restore(s: SnapshotEvent): void {
    if (s.groupSize !== undefined) this.groupSize = s.groupSize;
    this.counters = { ...s.counters };
    // snapshots written before keys were hashed hold the keys themselves
    for (const [key, scope] of s.keys ?? []) this.keys.set(Pool.keyHash(key), scope);
    for (const [hash, scope] of s.keyHashes ?? []) this.keys.set(hash, scope);
    for (const scope of this.keys.values()) this.keyed.set(scope.episode, scope);
    const now = Date.now();
    for (const [id, size, consumed] of s.groups) {
      // a group not consumed is closed again by its `abandon` event, which the compacted log keeps
      const g: Group = {
        id,
        seq: this.bySeq.length,
        size,
        episodes: [],
        finished: 0,
        abandoned: 0,
        closed: false,
        complete: consumed === 1,
        started: now,
        active: now,
        consumed: consumed === 1,
      };
      this.groups.set(id, g);
      this.bySeq.push(g);
      this.noteRound(id);
    }
    for (const [id, seq, finished, shipped, reward, abandoned] of s.dead) {
      const g = this.bySeq[seq];
      const ep: Episode = { id, group: g.id, agents: new Set(), calls: [], finished: finished === 1, bytes: 0 };
      if (shipped === 1) ep.shipped = true;
      if (reward !== null) ep.reward = reward;
      this.episodes.set(id, ep);
      g.episodes.push(id);
      if (ep.finished) g.finished++;
      else if (abandoned === 1) {
        ep.abandoned = 'abandoned';
        g.abandoned++;
      } else this.openEpisodes++;
    }
    for (const g of this.bySeq) {
      if (g.consumed) continue;
      if (g.finished + g.abandoned >= g.size) {
        g.complete = true;
        this.waitingGroups++;
      } else this.open.add(g);
    }
  }

  private episode(id: string, group: string, time: number): Episode {
    let ep = this.episodes.get(id);
    if (ep) {
      this.groups.get(ep.group)!.active = time;
      return ep;
    }
    let g = this.groups.get(group);
    if (!g) {
      g = {
        id: group,
        seq: this.bySeq.length,
        size: this.groupSize,
        episodes: [],
        finished: 0,
        abandoned: 0,
        closed: false,
        complete: false,
        started: time,
        active: time,
        consumed: false,
      };
      this.groups.set(group, g);
      this.bySeq.push(g);
      this.open.add(g);
      this.noteRound(group);
    }
    g.active = time;
    g.episodes.push(id);
    ep = { id, group, agents: new Set(), calls: [], finished: false, bytes: 0 };
    this.episodes.set(id, ep);
    this.openEpisodes++;
    return ep;
  }

  /** Keeps an instance's latest round, so the next record looks for room from there. */
  private noteRound(key: string): void {
    const i = key.indexOf(ROUND_SEP);
    if (i >= 0) this.rounds.set(key.slice(0, i), Math.max(this.rounds.get(key.slice(0, i)) ?? 0, Number(key.slice(i + 1))));
  }

  private finishEpisode(ep: Episode, reward: number, metadata: Record<string, unknown> | undefined, groupSize: number | undefined): void {
    ep.finished = true;
    this.openEpisodes--;
    ep.reward = reward;
    if (metadata) ep.metadata = metadata;
    this.counters.episodesFinished++;
    const g = this.groups.get(ep.group)!;
    if (groupSize !== undefined) g.size = groupSize;
    g.finished++;
    this.maybeComplete(g);
  }

  private abandonEpisode(ep: Episode, reason: string): void {
    ep.abandoned = reason;
    this.openEpisodes--;
    this.groups.get(ep.group)!.abandoned++;
  }

  /** Hands a group to the scheduler once its finished and abandoned episodes make its size, or it was closed. */
  private maybeComplete(g: Group): void {
    if (g.complete || g.consumed || !(g.closed || g.finished + g.abandoned >= g.size)) return;
    g.complete = true;
    this.open.delete(g);
    this.counters.groupsFinished++;
    this.waitingGroups++;
    this.onGroupFinished(g.seq);
  }

  /** The groups that have waited longest for their episodes: started the earliest (ms time), if any. */
  oldestOpen(): number | undefined {
    let t: number | undefined;
    for (const g of this.open) if (t === undefined || g.started < t) t = g.started;
    return t;
  }

  /** Frees a consumed group's records (the log keeps them). */
  release(seq: number): void {
    const g = this.bySeq[seq];
    g.consumed = true;
    this.open.delete(g);
    this.waitingGroups--;
    for (const id of g.episodes) this.free(this.episodes.get(id)!);
  }

  private free(ep: Episode): void {
    this.pendingBytes -= ep.bytes;
    ep.calls = [];
    delete ep.requests;
    ep.bytes = 0;
    delete ep.direct;
  }

  /** Finished (or abandoned) episodes not yet in the shared pool (Redis mode): shipped again after a restart. */
  unshipped(): Episode[] {
    return [...this.episodes.values()].filter((ep) => (ep.finished || ep.abandoned) && !ep.shipped);
  }

  /** Episodes started and not finished, and finished groups not consumed. */
  depth(): { openEpisodes: number; finishedGroups: number } {
    return { openEpisodes: this.openEpisodes, finishedGroups: this.waitingGroups };
  }
}

/** What identifies a slime record's content: the SHA-256 of its JSON as parsed. */
export function recordDigest(record: Record<string, unknown>): string {
  return createHash('sha256').update(JSON.stringify(record)).digest('base64url');
}

/** Equality of parsed JSON values, keys in any order (4× faster here than node's isDeepStrictEqual). */
export function jsonEqual(a: unknown, b: unknown): boolean {
  if (a === b) return true;
  if (typeof a !== 'object' || typeof b !== 'object' || a === null || b === null) return false;
  if (Array.isArray(a)) {
    if (!Array.isArray(b) || a.length !== b.length) return false;
    for (let i = 0; i < a.length; i++) if (!jsonEqual(a[i], b[i])) return false;
    return true;
  }
  if (Array.isArray(b)) return false;
  const keys = Object.keys(a);
  if (keys.length !== Object.keys(b).length) return false;
  for (const k of keys)
    if (!Object.hasOwn(b, k) || !jsonEqual((a as Record<string, unknown>)[k], (b as Record<string, unknown>)[k])) return false;
  return true;
}

/**
 * `call` as it is written (to the log, or to the shared pool) after `calls[0..n)` of its episode: its messages
 * after the longest prefix they share with the latest of those calls of the same agent, which it names (and that
 * call's tools, when they are the same); the call itself when it shares nothing.
 */
export function continuing(calls: RecordedCall[], n: number, call: RecordedCall): RecordedCall {
  const messages = call.request.messages;
  if (!messages) return call;
  let base: RecordedCall | undefined;
  for (let i = n - 1; i >= 0 && !base; i--) if (calls[i].agent === call.agent && calls[i].request.messages) base = calls[i];
  if (!base) return call;
  const prev = base.request.messages!;
  let keep = 0;
  while (keep < prev.length && keep < messages.length && jsonEqual(prev[keep], messages[keep])) keep++;
  if (keep === 0) return call;
  const { tools, ...rest } = call.request;
  const request: LoggedRequest = { ...rest, from: base.id, keep, messages: messages.slice(keep) };
  if (tools !== undefined) {
    if (base.request.tools !== undefined && jsonEqual(tools, base.request.tools)) request.sameTools = true;
    else request.tools = tools;
  }
  return { ...call, request };
}

/**
 * A call as written by `continuing`, whole again after `calls` (the episode's calls before it, whole): the messages
 * it shares are the earlier call's own objects.
 */
export function expanded(calls: RecordedCall[], call: RecordedCall, episode: string): RecordedCall {
  const { from, keep, sameTools, ...rest } = call.request as LoggedRequest;
  if (from === undefined) return call;
  let base: RecordedCall | undefined;
  for (let i = calls.length - 1; i >= 0 && !base; i--) if (calls[i].id === from) base = calls[i];
  const prev = base?.request.messages;
  if (
    !prev ||
    !Number.isSafeInteger(keep) ||
    keep! < 1 ||
    keep! > prev.length ||
    !Array.isArray(rest.messages) ||
    (sameTools && !base!.request.tools)
  ) {
    throw new TreepackError(
      'E_INPUT',
      `call ${JSON.stringify(call.id)} of episode ${JSON.stringify(episode)} continues call ${JSON.stringify(from)}, which is not before it (or has fewer than ${keep} messages)`,
    );
  }
  const request: CallRequest = { ...rest, messages: prev.slice(0, keep).concat(rest.messages) };
  if (sameTools) request.tools = base!.request.tools;
  return { ...call, request };
}
