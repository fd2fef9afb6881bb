/**
 * The event kinds of the service's durable log, as one discriminated union, and their check on replay: a line of
 * an unknown kind, or one missing a field its kind needs (a log damaged into other JSON, or written by another
 * version), is refused with its line and field before anything applies it, never left to fail deep inside the pool.
 */
import { describeValue, TreepackError } from '../errors.js';
import type { PoolEvent, SnapshotEvent } from './pool.js';

/** The trainer feed's own events (feed.ts): steps taken, micro-batches handed out and acknowledged, flushes. */
export type FeedEvent =
  | { type: 'take'; step: number; groups: number[]; whole?: boolean }
  | { type: 'handout'; id: string; until: number; client?: string }
  | { type: 'ack'; id: string; of: number }
  | { type: 'flush' };

/** Every event the log holds. */
export type ServiceEvent = PoolEvent | SnapshotEvent | FeedEvent;

type Kind = 'string' | 'number' | 'int' | 'boolean' | 'object' | 'array';
/** A field's kind; `?`: it may be absent (or null). */
type Fields = Record<string, Kind | `${Kind}?`>;

const SCOPE: Fields = { episode: 'string', agent: 'string?', group: 'string?' };
const CALL: Fields = {
  id: 'string',
  kind: 'string',
  time: 'number',
  policyVersion: 'number',
  request: 'object',
  output: 'object',
  agent: 'string?',
  requestId: 'string?',
  siblings: 'array?',
};
const REQUEST: Fields = { messages: 'array?', tools: 'array?', prompt: 'string?', from: 'string?', keep: 'int?', sameTools: 'boolean?' };

/** The fields each kind needs: a kind added to ServiceEvent without its entry here does not compile. */
const FIELDS: Record<ServiceEvent['type'], Fields> = {
  snapshot: {
    steps: 'int',
    version: 'number',
    counters: 'object',
    groups: 'array',
    dead: 'array',
    groupSize: 'int?',
    flushBelow: 'int?',
    flushing: 'boolean?',
    keys: 'array?',
    keyHashes: 'array?',
  },
  key: { hash: 'string?', key: 'string?', scope: 'object', time: 'number?' },
  call: { episode: 'string', group: 'string?', call: 'object' },
  finish: { episode: 'string', reward: 'number', metadata: 'object?', group_size: 'int?', time: 'number' },
  record: { episode: 'string', group: 'string', record: 'object', reward: 'number', time: 'number' },
  'group-size': { size: 'int' },
  ship: { episode: 'string' },
  abandon: { group: 'string', episode: 'string?', reason: 'string', time: 'number' },
  take: { step: 'int', groups: 'array', whole: 'boolean?' },
  handout: { id: 'string', until: 'number', client: 'string?' },
  ack: { id: 'string', of: 'int' },
  flush: {},
};

export const EVENT_TYPES = Object.keys(FIELDS) as ServiceEvent['type'][];
const FEED_TYPES = new Set<string>(['take', 'handout', 'ack', 'flush'] satisfies FeedEvent['type'][]);

export function isFeedEvent(e: ServiceEvent): e is FeedEvent {
  return FEED_TYPES.has(e.type);
}

const isObj = (v: unknown): v is Record<string, unknown> => typeof v === 'object' && v !== null && !Array.isArray(v);

function is(kind: Kind, v: unknown): boolean {
  if (kind === 'int') return Number.isSafeInteger(v);
  if (kind === 'number') return typeof v === 'number' && Number.isFinite(v);
  if (kind === 'object') return isObj(v);
  if (kind === 'array') return Array.isArray(v);
  return typeof v === kind;
}

/** The first field of `o` (named under `at`) that is not of its kind, as [field, expected], else undefined. */
function badField(o: Record<string, unknown>, fields: Fields, at: string): [string, string] | undefined {
  for (const [name, spec] of Object.entries(fields)) {
    const optional = spec.endsWith('?');
    const kind = (optional ? spec.slice(0, -1) : spec) as Kind;
    const v = o[name];
    if (optional && (v === undefined || v === null)) continue;
    if (!is(kind, v))
      return [
        at + name,
        `${optional ? 'absent or ' : ''}${kind === 'int' ? 'an integer' : kind === 'array' ? 'a list' : `a${kind === 'object' ? 'n' : ''} ${kind}`}`,
      ];
  }
  return undefined;
}

/** `e`, a parsed line of the log at `file`:`line`, as the event it is; a TreepackError naming the line and field if not. */
export function checkEvent(e: unknown, file: string, line: number): ServiceEvent {
  const fail = (field: string, message: string) => new TreepackError('E_INPUT', `damaged log: ${message}`, { file, line, field });
  const type = isObj(e) ? e.type : undefined;
  if (!isObj(e) || typeof type !== 'string' || !Object.hasOwn(FIELDS, type)) {
    const got = !isObj(e) ? describeValue(e) : type === undefined ? 'none' : describeValue(type);
    throw fail('type', `expected an event with a "type" of ${EVENT_TYPES.join(', ')}, got ${got}`);
  }
  let bad = badField(e, FIELDS[type as ServiceEvent['type']], '');
  if (!bad && type === 'key') {
    bad =
      typeof e.hash === 'string' || typeof e.key === 'string'
        ? badField(e.scope as Record<string, unknown>, SCOPE, 'scope.')
        : ['hash', 'a string'];
  }
  if (!bad && type === 'call') {
    const call = e.call as Record<string, unknown>;
    bad = badField(call, CALL, 'call.') ?? badField(call.request as Record<string, unknown>, REQUEST, 'call.request.');
  }
  if (bad) {
    const [field, expected] = bad;
    const value = field.split('.').reduce<unknown>((o, k) => (isObj(o) ? o[k] : undefined), e);
    throw fail(
      field,
      `a ${type} event needs ${JSON.stringify(field)} to be ${expected}, got ${value === undefined ? 'nothing' : describeValue(value)}`,
    );
  }
  return e as unknown as ServiceEvent;
}
