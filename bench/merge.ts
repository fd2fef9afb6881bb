/**
 * Timeline merge against an AgentJet-style greedy pairwise merge (ajet/context_tracker/timeline_merging: walk the
 * timelines newest first, let each absorb every later one that is a message prefix of it, toggling the author),
 * written here as the baseline: same timelines, same run. Per dataset: samples and packed tokens after merging,
 * merge time, and wrong merges (an absorbed timeline that is not a prefix of its absorber once tool calls count,
 * the AgentJet text-compare hazard).
 *
 * Two scopes: per episode (how AgentJet runs it, one tracker per episode) and one pool holding every timeline
 * (a long-horizon run, or a framework merging a whole batch), where the pairwise cost shows.
 */
import { performance } from 'node:perf_hooks';
import { speed } from './format.js';
import {
  mergeDefaults,
  mergeTimelines,
  packForest,
  readRecords,
  timelineFromChat,
  timelineToSample,
  toSequences,
  type ChatEncoder,
  type Timeline,
  type TimelineMessage,
} from '../src/index.js';

/** A timeline as AgentJet sees it in text mode: the content of each message, nothing else. */
interface Tracked {
  timeline: Timeline;
  contents: string[];
}

export interface MergeFigures {
  samples: number;
  packedTokens: number;
  naiveTokens: number;
  seconds: number;
  wrongMerges: number;
}

export interface MergeBenchRow {
  dataset: string;
  scope: 'per episode' | 'one pool';
  timelines: number;
  treepack: MergeFigures;
  agentjet: MergeFigures;
}

export async function loadTracked(file: string, encoder: ChatEncoder): Promise<Tracked[]> {
  const out: Tracked[] = [];
  const policy = mergeDefaults();
  for await (const r of readRecords(file)) {
    if (r.kind !== 'chat') continue;
    const rec = r;
    out.push({
      timeline: timelineFromChat(rec, encoder, policy).timeline,
      contents: [...rec.messages, rec.response].map((m) => m.content ?? ''),
    });
  }
  return out;
}

/** AgentJet's merge_tracker_timelines with its defaults (text compare, tools ignored); absorbed flags as an array. */
function agentJetMerge(group: Tracked[]): { kept: TimelineMessage[][]; owners: Tracked[]; absorptions: [Tracked, Tracked][] } {
  const rev = group.slice().reverse();
  const msgs = rev.map((t) => t.timeline.messages.slice());
  const absorbed = new Uint8Array(rev.length);
  const absorptions: [Tracked, Tracked][] = [];
  for (let i = 0; i < rev.length; i++) {
    if (absorbed[i]) continue;
    for (let j = i + 1; j < rev.length; j++) {
      if (absorbed[j]) continue;
      const src = rev[i],
        tgt = rev[j];
      if (src.contents.length < tgt.contents.length) continue;
      let all = true;
      for (let k = 0; k < tgt.contents.length && all; k++) all = src.contents[k] === tgt.contents[k];
      if (!all) continue;
      for (let k = 0; k < tgt.contents.length; k++)
        if (msgs[j][k].author === 'llm' && msgs[i][k].author !== 'llm') msgs[i][k] = msgs[j][k]!;
      absorbed[j] = 1;
      absorptions.push([src, tgt]);
    }
  }
  const kept: TimelineMessage[][] = [];
  const owners: Tracked[] = [];
  for (let i = rev.length - 1; i >= 0; i--) {
    if (absorbed[i]) continue;
    kept.push(msgs[i]);
    owners.push(rev[i]);
  }
  return { kept, owners, absorptions };
}

/** A merge is wrong when the absorbed timeline is not a message prefix of its absorber once tool calls count. */
function isPrefix(short: Timeline, long: Timeline): boolean {
  if (short.messages.length > long.messages.length) return false;
  return short.messages.every((m, k) => m.text === long.messages[k].text);
}

function byGroup(tracked: Tracked[], pool: boolean): Tracked[][] {
  if (pool) return [tracked];
  const m = new Map<string, Tracked[]>();
  for (const t of tracked) {
    const k = `${t.timeline.episode}\u0000${t.timeline.agent ?? ''}`;
    const g = m.get(k);
    if (g) g.push(t);
    else m.set(k, [t]);
  }
  return [...m.values()];
}

function packed(samples: { tokens: Int32Array }[]): { packedTokens: number; naiveTokens: number } {
  const seqs = toSequences(samples as never);
  return { packedTokens: packForest(seqs).input_ids.length, naiveTokens: seqs.tokens.length };
}

export function compareMerges(dataset: string, tracked: Tracked[], pool: boolean, reps: number): MergeBenchRow {
  // One pool: every timeline in one merge group for both sides (one episode, agent and reward).
  const input = pool
    ? tracked.map((t) => ({ ...t, timeline: { ...t.timeline, episode: 'pool', agent: undefined, reward: undefined } }))
    : tracked;
  const timelines = input.map((t) => t.timeline);
  let best = Infinity;
  let ours = mergeTimelines(timelines);
  for (let r = 0; r < reps; r++) {
    const t0 = performance.now();
    ours = mergeTimelines(timelines);
    best = Math.min(best, (performance.now() - t0) / 1000);
  }
  const byId = new Map(timelines.map((t) => [t.id, t]));
  let oursWrong = 0;
  for (const s of ours.samples) for (const id of s.merged_from ?? []) if (!isPrefix(byId.get(id)!, byId.get(s.id)!)) oursWrong++;

  // Both sides are timed the same way, from timelines to samples, best of `reps` after one warm-up run.
  const theirs = () => {
    const groups = byGroup(input, pool).map(agentJetMerge);
    return { groups, samples: groups.flatMap((g) => g.kept.map((msgs, i) => timelineToSample(g.owners[i].timeline, msgs))) };
  };
  let { groups, samples: theirSamples } = theirs();
  let theirsSeconds = Infinity;
  for (let r = 0; r < reps; r++) {
    const t0 = performance.now();
    ({ groups, samples: theirSamples } = theirs());
    theirsSeconds = Math.min(theirsSeconds, (performance.now() - t0) / 1000);
  }
  const theirsWrong = groups.reduce((a, g) => a + g.absorptions.filter(([src, tgt]) => !isPrefix(tgt.timeline, src.timeline)).length, 0);
  return {
    dataset,
    scope: pool ? 'one pool' : 'per episode',
    timelines: timelines.length,
    treepack: { samples: ours.samples.length, ...packed(ours.samples), seconds: best, wrongMerges: oursWrong },
    agentjet: { samples: theirSamples.length, ...packed(theirSamples), seconds: theirsSeconds, wrongMerges: theirsWrong },
  };
}

export function printMergeRow(r: MergeBenchRow): void {
  const f = (x: MergeFigures) =>
    `${String(x.samples).padStart(6)} samples, ${x.naiveTokens.toLocaleString('en-US').padStart(11)} naive → ${x.packedTokens.toLocaleString('en-US').padStart(9)} packed tokens, ` +
    `${(x.seconds * 1e3).toFixed(2).padStart(9)} ms, ${x.wrongMerges} wrong merges`;
  console.log(`  ${r.scope} (${r.timelines} timelines):`);
  console.log(`    treepack  ${f(r.treepack)}`);
  console.log(`    agentjet  ${f(r.agentjet)}`);
  console.log(`    treepack is ${speed(r.agentjet.seconds, r.treepack.seconds)} than the greedy pairwise merge`);
}
