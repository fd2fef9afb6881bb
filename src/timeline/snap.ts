/**
 * Timeline snap (diagnostic): a context that extends no earlier context of its merge group. Agents append to
 * their context, so each call should extend an earlier one; a snap means the framework rewrote history
 * (truncation, summarisation, a changed system prompt) and the sharing with everything before is lost from the
 * break on. Input order within a group is taken as time.
 */
import type { Timeline } from './model.js';
import type { Trie } from './trie.js';

/**
 * - `system`: the first message differs (a changed system prompt);
 * - `truncation`: the context continues with a message the previous one had further on (messages dropped);
 * - `rollback`: the context is a strict prefix of the previous one (the agent went back);
 * - `rewrite`: a message was replaced (a summary, an edited turn).
 */
export type SnapKind = 'system' | 'truncation' | 'rollback' | 'rewrite';

/** A context that extends no earlier context of its episode: where it happened, of what kind, and the tokens it costs. */
export interface Snap {
  episode: string;
  agent?: string;
  record: string; // the timeline that snapped
  previous: string; // the timeline before it in its group
  message: number; // index of the first message that differs from the previous timeline
  kind: SnapKind;
  lostTokens: number; // tokens of the previous timeline past the break: sharing it would have had
}

/**
 * Snap figures of a whole input in bounded memory: counts, tokens lost and kinds over every snap, and the
 * snaps themselves only up to `keep` (an input far larger than memory may snap once per call).
 */
export interface SnapSummary {
  count: number;
  lostTokens: number;
  kinds: Partial<Record<SnapKind, number>>;
  first: Snap[];
}

export function emptySnapSummary(): SnapSummary {
  return { count: 0, lostTokens: 0, kinds: {}, first: [] };
}

export function addSnaps(summary: SnapSummary, snaps: readonly Snap[], keep = 100): void {
  for (const s of snaps) {
    summary.count++;
    summary.lostTokens += s.lostTokens;
    summary.kinds[s.kind] = (summary.kinds[s.kind] ?? 0) + 1;
    if (summary.first.length < keep) summary.first.push(s);
  }
}

export function detectSnaps(ts: readonly Timeline[], trie: Trie): Snap[] {
  const { parent, depth, terminal, key } = trie;
  const first = new Int32Array(trie.size).fill(ts.length); // earliest timeline ending at each node
  for (let t = ts.length - 1; t >= 0; t--) first[terminal[t]] = t;
  const snaps: Snap[] = [];
  for (let t = 1; t < ts.length; t++) {
    let extendsEarlier = false;
    for (let n = terminal[t]; n > 0 && !extendsEarlier; n = parent[n]!) extendsEarlier = first[n] < t;
    if (extendsEarlier) continue;
    const a = terminal[t],
      b = terminal[t - 1];
    let x = a,
      y = b;
    while (depth[x] > depth[y]) x = parent[x]!;
    while (depth[y] > depth[x]) y = parent[y]!;
    while (x !== y) {
      x = parent[x]!;
      y = parent[y]!;
    }
    const common = depth[x];
    const prev = ts[t - 1];
    let kind: SnapKind;
    if (common === 0) kind = 'system';
    else if (depth[a] === common) kind = 'rollback';
    else {
      let next = a; // t's node at depth common + 1: its first differing message
      while (depth[next] > common + 1) next = parent[next]!;
      let dropped = false;
      for (let n = b; depth[n] > common + 1 && !dropped; n = parent[n]!) dropped = key[n] === key[next];
      kind = dropped ? 'truncation' : 'rewrite';
    }
    let lostTokens = 0;
    for (let i = common; i < prev.messages.length; i++) lostTokens += prev.messages[i].tokens.length;
    const snap: Snap = { episode: ts[t].episode, record: ts[t].id, previous: prev.id, message: common, kind, lostTokens };
    if (ts[t].agent !== undefined) snap.agent = ts[t].agent;
    snaps.push(snap);
  }
  return snaps;
}
