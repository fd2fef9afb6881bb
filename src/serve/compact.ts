/**
 * Log compaction: a log's committed events rewritten as one `snapshot` event followed by the events still live,
 * in their order. The snapshot keeps what consumed groups and shipped episodes leave behind (their ids and
 * state, so a late resend is still refused and group numbers stay put), the steps done and the trainer version;
 * the live events are the calls, records and finishes of episodes not consumed or shipped, and the `take` and
 * `ack` events of steps not acknowledged whole. Replaying the result leaves the pool and the feed as replaying
 * the original does, which is what makes swapping one file for the other safe at any moment.
 */
import type { LogEvent } from './log.js';
import { Pool, type SnapshotEvent } from './pool.js';

interface StepState {
  groups: number[];
  acked: Set<string>;
  done: boolean;
}

/** Groups numbered below this may form smaller steps, as of the snapshot. */
export function snapshotFlushBelow(s: SnapshotEvent): number {
  return s.flushBelow ?? (s.flushing ? s.groups.length : 0);
}

/** The compacted equivalent of `events` (a whole log, possibly starting with an earlier snapshot). */
export function compactEvents(events: LogEvent[], groupSize: number): LogEvent[] {
  const pool = new Pool({ groupSize });
  const steps: StepState[] = [];
  let flushBelow = 0;
  let version = 0;
  let setSize: number | undefined;
  const finishStep = (s: StepState, counts: boolean) => {
    s.done = true;
    if (counts) version++;
    for (const g of s.groups) pool.release(g);
  };
  for (const e of events) {
    if (e.type === 'snapshot') {
      const s = e as unknown as SnapshotEvent;
      pool.apply(e);
      for (let n = 0; n < s.steps; n++) steps[n] = { groups: [], acked: new Set(), done: true };
      ({ version, groupSize: setSize } = s);
      flushBelow = snapshotFlushBelow(s);
    } else if (e.type === 'take') {
      const s: StepState = { groups: e.groups as number[], acked: new Set(), done: false };
      steps[e.step as number] = s;
      if (e.whole) finishStep(s, false);
    } else if (e.type === 'handout') continue;
    else if (e.type === 'ack') {
      const s = steps[Number((e.id as string).split('.')[0])];
      if (!s || s.done) continue;
      s.acked.add(e.id as string);
      if (s.acked.size === e.of) finishStep(s, true);
    } else if (e.type === 'flush') flushBelow = Math.max(flushBelow, pool.bySeq.length);
    else {
      if (e.type === 'group-size') setSize = e.size as number;
      pool.apply(e);
    }
  }

  const dead = (episode: string) => {
    const ep = pool.episodes.get(episode)!;
    return ep.shipped === true || pool.groups.get(ep.group)!.consumed;
  };
  const live: LogEvent[] = [];
  const counters = { ...pool.counters };
  for (const e of events) {
    if (e.type === 'call' || e.type === 'record' || e.type === 'finish') {
      if (dead(e.episode as string)) continue;
      live.push(e);
      if (e.type === 'call') counters.calls--;
      else counters.episodesFinished--;
    } else if (e.type === 'abandon') {
      if (e.episode !== undefined ? !dead(e.episode as string) : !pool.groups.get(e.group as string)!.consumed) live.push(e);
    } else if (e.type === 'take' || e.type === 'ack' || e.type === 'handout') {
      const n = e.type === 'take' ? (e.step as number) : Number((e.id as string).split('.')[0]);
      if (!steps[n].done) live.push(e);
    }
  }

  const snap: SnapshotEvent = {
    type: 'snapshot',
    flushBelow,
    steps: steps.length,
    version,
    counters,
    keyHashes: [...pool.keys],
    groups: [],
    dead: [],
  };
  if (setSize !== undefined) snap.groupSize = setSize;
  for (const g of pool.bySeq) {
    snap.groups.push([g.id, g.size, g.consumed ? 1 : 0]);
    let deadDone = 0;
    for (const id of g.episodes) {
      if (!dead(id)) continue;
      const ep = pool.episodes.get(id)!;
      if (ep.finished || ep.abandoned) deadDone++;
      snap.dead.push([id, g.seq, ep.finished ? 1 : 0, ep.shipped ? 1 : 0, ep.reward ?? null, ep.abandoned ? 1 : 0]);
    }
    // A group completed by live events counts again when they are replayed.
    if (!g.consumed && g.complete && deadDone < g.size) counters.groupsFinished--;
  }
  snap.counters = counters;
  return [snap as unknown as LogEvent, ...live];
}
