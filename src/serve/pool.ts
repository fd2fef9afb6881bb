/**
 * The rollout pool: episodes, their recorded calls and their groups, rebuilt from the durable log's events by
 * the same `apply` that handles them live, so a replayed service is in exactly the state its clients were told.
 *
 * Groups are numbered in submission order (the first time any of their episodes is seen); a group is finished
 * when `groupSize` of its episodes are. Which finished groups go to a consumer, and when, is the scheduler's job
 * (Collector in src/pack/schedule.ts); the pool only says which groups are finished and holds their records.
 */
import { randomBytes } from 'node:crypto';
import { TreepackError } from '../errors.js';
import type { SnapshotEvent } from './compact.js';
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
  time: number;
  policyVersion: number;
  request: CallRequest;
  output: EngineOutput;
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
  bytes: number;
  /** handed to the shared pool (Redis mode): its records live there now, not here */
  shipped?: boolean;
}

export interface Group {
  id: string;
  seq: number; // submission order
  size: number;
  episodes: string[];
  finished: number;
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

export type PoolEvent =
  | { type: 'key'; key: string; scope: Scope }
  | { type: 'call'; episode: string; group?: string; call: RecordedCall }
  | { type: 'finish'; episode: string; reward: number; metadata?: Record<string, unknown>; group_size?: number; time: number }
  | { type: 'record'; episode: string; group: string; record: Record<string, unknown>; reward: number; time: number }
  | { type: 'group-size'; size: number }
  | { type: 'ship'; episode: string };

/** A request the pool refuses: HTTP status and a message naming the field. */
export class PoolError extends Error {
  constructor(
    readonly status: number,
    message: string,
  ) {
    super(message);
  }
}

const ID_PREFIX = randomBytes(12).toString('base64url') + '-';
let idCounter = 0;

export class Pool {
  readonly episodes = new Map<string, Episode>();
  readonly groups = new Map<string, Group>();
  /** groups by submission number */
  readonly bySeq: Group[] = [];
  readonly keys = new Map<string, Scope>();
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
        if (ep.finished) throw new PoolError(409, `episode ${JSON.stringify(e.episode)} is already finished`);
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

  /** Whether a call may be recorded under this episode (checked before the engine is called, and again after). */
  checkCall(episode: string, group: string | undefined): void {
    const ep = this.episodes.get(episode);
    if (ep?.finished) throw new PoolError(409, `episode ${JSON.stringify(episode)} is finished; a new call needs a new episode id`);
    if (ep && group !== undefined && group !== ep.group) throw new PoolError(409, `episode ${JSON.stringify(episode)} belongs to group ${JSON.stringify(ep.group)}, not ${JSON.stringify(group)}`);
    this.checkGroupOpen(group ?? episode, ep);
  }

  private checkGroupOpen(group: string, ep: Episode | undefined): void {
    const g = this.groups.get(group);
    if (g && !ep && g.episodes.length >= g.size) throw new PoolError(409, `group ${JSON.stringify(group)} already has its ${g.size} episodes`);
    if (g?.consumed) throw new PoolError(409, `group ${JSON.stringify(group)} was already consumed`);
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
        this.keys.set(e.key, e.scope);
        return;
      case 'group-size':
        this.groupSize = e.size;
        return;
      case 'call': {
        const ep = this.episode(e.episode, e.group ?? e.episode);
        if (e.call.agent !== undefined) ep.agents.add(e.call.agent);
        ep.calls.push(expanded(ep.calls, e.call, ep.id));
        ep.bytes += bytes;
        this.pendingBytes += bytes;
        this.counters.calls++;
        return;
      }
      case 'record': {
        const ep = this.episode(e.episode, e.group);
        ep.direct = e.record;
        ep.bytes = bytes;
        this.pendingBytes += bytes;
        this.finishEpisode(ep, e.reward, undefined, undefined);
        return;
      }
      case 'finish': {
        const ep = this.episodes.get(e.episode)!;
        this.finishEpisode(ep, e.reward, e.metadata, e.group_size);
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
    for (const [key, scope] of s.keys) this.keys.set(key, scope);
    for (const [id, size, consumed] of s.groups) {
      const g: Group = { id, seq: this.bySeq.length, size, episodes: [], finished: 0, consumed: consumed === 1 };
      this.groups.set(id, g);
      this.bySeq.push(g);
    }
    for (const [id, seq, finished, shipped, reward] of s.dead) {
      const g = this.bySeq[seq]!;
      const ep: Episode = { id, group: g.id, agents: new Set(), calls: [], finished: finished === 1, bytes: 0 };
      if (shipped === 1) ep.shipped = true;
      if (reward !== null) ep.reward = reward;
      this.episodes.set(id, ep);
      g.episodes.push(id);
      if (ep.finished) g.finished++;
      else this.openEpisodes++;
    }
    for (const g of this.bySeq) if (!g.consumed && g.finished >= g.size) this.waitingGroups++;
  }

  private episode(id: string, group: string): Episode {
    let ep = this.episodes.get(id);
    if (ep) return ep;
    let g = this.groups.get(group);
    if (!g) {
      g = { id: group, seq: this.bySeq.length, size: this.groupSize, episodes: [], finished: 0, consumed: false };
      this.groups.set(group, g);
      this.bySeq.push(g);
    }
    g.episodes.push(id);
    ep = { id, group, agents: new Set(), calls: [], finished: false, bytes: 0 };
    this.episodes.set(id, ep);
    this.openEpisodes++;
    return ep;
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
    if (g.finished === g.size) {
      this.counters.groupsFinished++;
      this.waitingGroups++;
      this.onGroupFinished(g.seq);
    }
  }

  /** Frees a consumed group's records (the log keeps them). */
  release(seq: number): void {
    const g = this.bySeq[seq]!;
    g.consumed = true;
    this.waitingGroups--;
    for (const id of g.episodes) this.free(this.episodes.get(id)!);
  }

  private free(ep: Episode): void {
    this.pendingBytes -= ep.bytes;
    ep.calls = [];
    ep.bytes = 0;
    delete ep.direct;
  }

  /** Finished episodes not yet in the shared pool (Redis mode): shipped again after a restart. */
  unshipped(): Episode[] {
    return [...this.episodes.values()].filter((ep) => ep.finished && !ep.shipped);
  }

  /** Episodes started and not finished, and finished groups not consumed. */
  depth(): { openEpisodes: number; finishedGroups: number } {
    return { openEpisodes: this.openEpisodes, finishedGroups: this.waitingGroups };
  }
}

/** Equality of parsed JSON values, keys in any order (4× faster here than node's isDeepStrictEqual). */
function jsonEqual(a: unknown, b: unknown): boolean {
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
  for (const k of keys) if (!Object.hasOwn(b, k) || !jsonEqual((a as Record<string, unknown>)[k], (b as Record<string, unknown>)[k])) return false;
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
  for (let i = n - 1; i >= 0 && !base; i--) if (calls[i]!.agent === call.agent && calls[i]!.request.messages) base = calls[i];
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
  for (let i = calls.length - 1; i >= 0 && !base; i--) if (calls[i]!.id === from) base = calls[i];
  const prev = base?.request.messages;
  if (!prev || !Number.isSafeInteger(keep) || keep! < 1 || keep! > prev.length || !Array.isArray(rest.messages) || (sameTools && !base!.request.tools)) {
    throw new TreepackError('E_INPUT', `call ${JSON.stringify(call.id)} of episode ${JSON.stringify(episode)} continues call ${JSON.stringify(from)}, which is not before it (or has fewer than ${keep} messages)`);
  }
  const request: CallRequest = { ...rest, messages: prev.slice(0, keep).concat(rest.messages) };
  if (sameTools) request.tools = base!.request.tools;
  return { ...call, request };
}
