/**
 * The trie of message identities of one merge group: node = a message reached through a given sequence of
 * earlier messages. Timeline A is a message-level prefix of B exactly when A's node is an ancestor-or-self of B's,
 * so every prefix relation is found in one pass over the messages (AgentJet compares every pair of timelines).
 *
 * Node numbers follow insertion order and so depend on input order; anything that must not (which child comes
 * first, which version wins) compares identity strings instead.
 */
import type { Timeline, TimelineMessage } from './model.js';

export interface Trie {
  /** parent[node]; -1 for the root (node 0, the empty context). */
  parent: Int32Array;
  depth: Int32Array;
  /** Identity string of each node's message ('' for the root). */
  key: string[];
  /** Node of each timeline's last message (the root for an empty timeline). */
  terminal: Int32Array;
  size: number;
}

const tokenString = (a: Int32Array) => Buffer.from(a.buffer, a.byteOffset, a.byteLength).toString('latin1');

/** What makes two messages the same under the compare level; tool calls count in both. */
function messageIdentity(m: TimelineMessage, level: 'text' | 'token'): string {
  if (level === 'text' && m.text !== undefined) return m.text;
  return `${m.role}\u0000${m.calls}\u0000${tokenString(m.tokens)}`;
}

/** Past this many children a node's child lookup goes through a map instead of a scan. */
const SCAN_CHILDREN = 8;

export function buildTrie(timelines: readonly Timeline[], level: 'text' | 'token'): Trie {
  let cap = 1024;
  let parent = new Int32Array(cap);
  let depth = new Int32Array(cap);
  const key: string[] = [''];
  parent[0] = -1;
  let size = 1;
  // Chains dominate agent data: a node usually has one child, and the message arriving is that child's. Comparing
  // the two strings (a length check, then memcmp) is far cheaper than hashing a copy of a 10 kB system prompt
  // for a map lookup, so children are scanned and only wide nodes get a map.
  const children: (number[] | undefined)[] = [undefined];
  const wide = new Map<number, Map<string, number>>();
  const terminal = new Int32Array(timelines.length);
  for (let t = 0; t < timelines.length; t++) {
    let node = 0;
    for (const m of timelines[t].messages) {
      const id = messageIdentity(m, level);
      const list = children[node];
      let child = -1;
      if (list && list.length <= SCAN_CHILDREN) {
        for (const c of list)
          if (key[c] === id) {
            child = c;
            break;
          }
      } else if (list) child = wide.get(node)!.get(id) ?? -1;
      if (child < 0) {
        if (size === cap) {
          cap *= 2;
          const p = new Int32Array(cap),
            d = new Int32Array(cap);
          p.set(parent);
          d.set(depth);
          parent = p;
          depth = d;
        }
        child = size++;
        parent[child] = node;
        depth[child] = depth[node] + 1;
        key[child] = id;
        children[child] = undefined;
        if (!list) children[node] = [child];
        else {
          list.push(child);
          if (list.length === SCAN_CHILDREN + 1) wide.set(node, new Map(list.map((c) => [key[c], c])));
          else if (list.length > SCAN_CHILDREN + 1) wide.get(node)!.set(id, child);
        }
      }
      node = child;
    }
    terminal[t] = node;
  }
  return { parent: parent.subarray(0, size), depth: depth.subarray(0, size), key, terminal, size };
}

/** Calls f(node, message) for every message of every timeline. */
export function visitMessages(
  trie: Trie,
  timelines: readonly Timeline[],
  f: (node: number, m: TimelineMessage, timeline: number) => void,
): void {
  for (let t = 0; t < timelines.length; t++) {
    const msgs = timelines[t].messages;
    let node = trie.terminal[t];
    for (let i = msgs.length - 1; i >= 0; i--) {
      f(node, msgs[i], t);
      node = trie.parent[node]!;
    }
  }
}
