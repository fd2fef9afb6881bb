/**
 * Timeline merge: a timeline whose messages are a message-level prefix of another's is absorbed into it, so one
 * sample carries both. AgentJet's policy names and defaults, with three differences: tool calls are always part
 * of a message's identity (two assistant turns calling different tools never compare equal), the result depends
 * only on the set of timelines, and the cost follows the number of messages, not the number of pairs.
 *
 * Per merge group (one episode, agent, reward and advantage; one tool list unless `ignoreTools`):
 *  1. Trie of message identities (trie.ts). Every trie leaf is one output sample; a timeline ending at an inner
 *     node is absorbed into the leaf reached by always taking the child with the smallest identity.
 *  2. Author toggle: where an absorbed timeline generated a message (`llm`) that is context in the leaf, the
 *     merged message takes the absorbed one's sampled tokens, mask and logprobs, so it stays trainable.
 *  3. Text compare can equate messages the policy sampled differently (same text, other tokens or logprobs). A
 *     sample can hold only one of them, so each node keeps the version with the smallest version and a timeline
 *     holding another version is not merged at all: it is emitted as it came, losing nothing.
 */
import type { Sample } from '../records/types.js';
import { compareVersions, countContextDrift, sampledVersions } from './drift.js';
import { timelineToSample } from './build.js';
import { mergeDefaults, type MergeOptions, type ResolvedMergeOptions, type Timeline, type TimelineMessage } from './model.js';
import { detectSnaps, type Snap } from './snap.js';
import { buildTrie, visitMessages, type Trie } from './trie.js';

/** What a timeline merge did: timelines in, samples out, absorbed timelines, drifted messages and snaps. */
export interface MergeReport {
  timelines: number; // in
  samples: number; // out
  absorbed: number; // timelines carried by another's sample: timelines = samples + absorbed
  apart: number; // timelines kept unmerged because a message of theirs was sampled another way elsewhere
  driftedMessages: number; // messages whose re-rendered context copies differ from the sampled tokens
  snaps: Snap[]; // with detectTimelineSnap
}

/** The samples a timeline merge produced and its report. */
export interface MergeResult {
  samples: Sample[];
  report: MergeReport;
}

function emptyMergeReport(): MergeReport {
  return { timelines: 0, samples: 0, absorbed: 0, apart: 0, driftedMessages: 0, snaps: [] };
}

/** Sample order: by id, numbers in ids by value, so `ep/2` precedes `ep/10`. */
export const byId = new Intl.Collator('en', { numeric: true }).compare;

function groupKey(t: Timeline, o: ResolvedMergeOptions): string {
  return JSON.stringify([
    t.episode,
    o.shareAcrossAgents ? null : (t.agent ?? null),
    t.reward ?? null,
    t.advantage ?? null,
    o.ignoreTools ? '' : t.tools,
  ]);
}

/** Merges timelines; the output is sorted by id and depends only on the set of inputs. */
export function mergeTimelines(timelines: readonly Timeline[], options: MergeOptions = {}): MergeResult {
  const o = mergeDefaults(options);
  const samples: Sample[] = [];
  const report = emptyMergeReport();
  for (const g of mergeGroups(timelines, o)) {
    if (o.detectTimelineSnap) report.snaps.push(...detectSnaps(g, buildTrie(g, o.timelineCompareLevel)));
    for (const part of byLogprobs(g)) mergeGroup(part, o, samples, report);
  }
  samples.sort((a, b) => byId(a.id, b.id));
  report.timelines = timelines.length;
  report.samples = samples.length;
  return { samples, report };
}

/** The snap diagnostic alone, for inputs that are not merged (`--no-merge`). */
export function snapsOnly(timelines: readonly Timeline[], options: MergeOptions = {}): Snap[] {
  const o = mergeDefaults(options);
  const snaps: Snap[] = [];
  for (const g of mergeGroups(timelines, o)) snaps.push(...detectSnaps(g, buildTrie(g, o.timelineCompareLevel)));
  return snaps;
}

/**
 * A merge group split by whether its generated messages carry rollout logprobs: one sample cannot hold messages
 * with and without them (timelineToSample), so the two kinds merge separately. Timelines that train nothing go
 * with the logprob kind when the group has it (they only contribute context either way). Input order is kept.
 */
function byLogprobs(g: Timeline[]): Timeline[][] {
  const kind = (t: Timeline) => {
    let trains = false;
    for (const m of t.messages) {
      if (!m.lossMask.includes(1)) continue;
      if (m.logprobs) return 2;
      trains = true;
    }
    return trains ? 1 : 0;
  };
  const kinds = g.map(kind);
  if (!kinds.includes(1) || !kinds.includes(2)) return [g];
  return [g.filter((_, i) => kinds[i] !== 1), g.filter((_, i) => kinds[i] === 1)];
}

/** Timelines split by merge group, each in input order (the snap diagnostic reads input order as time). */
function mergeGroups(timelines: readonly Timeline[], o: ResolvedMergeOptions): Iterable<Timeline[]> {
  const groups = new Map<string, Timeline[]>();
  for (const t of timelines) {
    const k = groupKey(t, o);
    const g = groups.get(k);
    if (g) g.push(t);
    else groups.set(k, [t]);
  }
  return groups.values();
}

function mergeGroup(ts: Timeline[], o: ResolvedMergeOptions, out: Sample[], report: MergeReport): void {
  const trie = buildTrie(ts, o.timelineCompareLevel);
  const visit = (f: (node: number, m: TimelineMessage, t: number) => void) => visitMessages(trie, ts, f);
  const chosen = sampledVersions(trie.size, visit);
  const apart = new Uint8Array(ts.length);
  visit((n, m, t) => {
    if (m.author === 'llm' && compareVersions(m, chosen[n]!) !== 0) apart[t] = 1;
  });
  report.driftedMessages += countContextDrift(chosen, visit);

  const canon = canonicalLeaves(trie, ts.length, (t) => apart[t] === 0);
  const buckets = new Map<number, number[]>();
  for (let t = 0; t < ts.length; t++) {
    if (apart[t]) {
      report.apart++;
      out.push(timelineToSample(ts[t]));
      continue;
    }
    const leaf = canon[trie.terminal[t]];
    const b = buckets.get(leaf);
    if (b) b.push(t);
    else buckets.set(leaf, [t]);
  }
  const trained = new Int32Array(trie.size).fill(-1); // bucket leaf that trains the node
  for (const [leaf, members] of buckets) {
    let owner = -1;
    for (const t of members) {
      if (trie.terminal[t] === leaf && (owner < 0 || byId(ts[t].id, ts[owner].id) < 0)) owner = t;
      const msgs = ts[t].messages;
      let n = trie.terminal[t];
      for (let i = msgs.length - 1; i >= 0; i--, n = trie.parent[n]!) if (msgs[i].author === 'llm') trained[n] = leaf;
    }
    const own = ts[owner];
    const msgs: TimelineMessage[] = new Array<TimelineMessage>(own.messages.length);
    let n = leaf;
    for (let i = own.messages.length - 1; i >= 0; i--, n = trie.parent[n]!) {
      const s = chosen[n];
      if (trained[n] === leaf) msgs[i] = s!;
      else if (s && o.fixRetokenizationDrift)
        msgs[i] = { ...s, author: 'env', lossMask: new Uint8Array(s.tokens.length), logprobs: undefined };
      else msgs[i] = own.messages[i]!;
    }
    const sample = timelineToSample(own, msgs);
    if (members.length > 1)
      sample.merged_from = members
        .filter((t) => t !== owner)
        .map((t) => ts[t].id)
        .sort(byId);
    report.absorbed += members.length - 1;
    out.push(sample);
  }
}

/**
 * For every node on a kept timeline's path, the leaf its timelines are absorbed into: a leaf itself, else the
 * canonical leaf of its child with the smallest identity. Children are numbered after their parents, so one
 * backward pass sees every child before its parent.
 */
function canonicalLeaves(trie: Trie, count: number, kept: (t: number) => boolean): Int32Array {
  const live = new Uint8Array(trie.size);
  for (let t = 0; t < count; t++) {
    if (!kept(t)) continue;
    for (let n = trie.terminal[t]; n >= 0 && !live[n]; n = trie.parent[n]!) live[n] = 1;
  }
  const best = new Int32Array(trie.size).fill(-1);
  const canon = new Int32Array(trie.size).fill(-1);
  for (let n = trie.size - 1; n >= 0; n--) {
    if (!live[n]) continue;
    canon[n] = best[n] < 0 ? n : canon[best[n]];
    const p = trie.parent[n];
    if (p >= 0 && (best[p] < 0 || trie.key[n] < trie.key[best[p]])) best[p] = n;
  }
  return canon;
}
