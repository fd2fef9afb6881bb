/**
 * The TypeScript reference packer: token sequences (CSR) → the exact prefix forest in canonical DFS preorder.
 *
 * Canonical layout: the trie of all sequences, roots and children ordered by ascending token id, laid out in
 * preorder. Walking the sequences in lexicographic order (a proper prefix before its extensions) visits the trie
 * in exactly that preorder, so after sorting, sequence j only adds its tokens past lcp(j-1, j). The node arrays
 * therefore depend on the multiset of sequences alone, and N is the number of distinct prefixes by construction.
 *
 * The sort is an LCP-aware merge sort (Ng & Kakehi): every head in a merge carries its LCP with the last output,
 * so a token is compared only where it can decide something. Agent data is chains of requests that extend each
 * other; a plain comparison sort would rescan those shared prefixes at every level of the sort.
 */
import type { Forest, Sequences } from './contract.js';
import { validateSequences } from './validate.js';

/** Tokens compared one by one before any block compare (most comparisons end within a few), and the smallest block. */
const PROBE = 64;
/** The largest block one native compare covers. */
const MAX_BLOCK = 4096;

/**
 * Length of the common prefix of sequences a and b, starting the scan at `from` (known equal before it). `bytes` is
 * the tokens' memory: chains of requests share thousands of tokens, and memcmp (Buffer.compare) passes over them
 * several times faster than a loop over the Int32Array. A block that matches is skipped, one that differs is halved
 * (memcmp stops at the first difference, so a failed block costs no more than its matching part), down to PROBE
 * tokens around the first difference, which a short loop finds.
 */
function lcpFrom(tokens: Int32Array, bytes: Buffer, offsets: Int32Array, a: number, b: number, from: number): number {
  const sa = offsets[a],
    sb = offsets[b];
  const n = Math.min(offsets[a + 1] - sa, offsets[b + 1] - sb);
  let h = from;
  const probe = Math.min(n, h + PROBE);
  while (h < probe && tokens[sa + h] === tokens[sb + h]) h++;
  if (h < probe) return h;
  for (let step = MAX_BLOCK; step >= PROBE;) {
    const equal = h + step <= n && bytes.compare(bytes, 4 * (sb + h), 4 * (sb + h + step), 4 * (sa + h), 4 * (sa + h + step)) === 0;
    if (equal) h += step;
    else step >>= 1;
  }
  while (h < n && tokens[sa + h] === tokens[sb + h]) h++;
  return h;
}

/**
 * Sorts sequence indices lexicographically. Returns `order` (sorted indices) and `lcp` where lcp[k] is the
 * common prefix length of order[k-1] and order[k] (lcp[0] = 0). Equal sequences keep input order.
 */
export function sortSequences(seqs: Sequences): { order: Int32Array; lcp: Int32Array } {
  const { tokens, offsets } = seqs;
  const bytes = Buffer.from(tokens.buffer, tokens.byteOffset, tokens.byteLength);
  const S = offsets.length - 1;
  let order = new Int32Array(S);
  let lcp = new Int32Array(S);
  for (let i = 0; i < S; i++) order[i] = i;
  let nextOrder = new Int32Array(S);
  let nextLcp = new Int32Array(S);
  for (let width = 1; width < S; width *= 2) {
    for (let lo = 0; lo < S; lo += 2 * width) {
      const mid = Math.min(lo + width, S),
        hi = Math.min(lo + 2 * width, S);
      if (mid >= hi) {
        nextOrder.set(order.subarray(lo, hi), lo);
        nextLcp.set(lcp.subarray(lo, hi), lo);
        continue;
      }
      // Heads i (left run) and j (right run); hi_/hj are their LCPs with the last element written.
      let i = lo,
        j = mid,
        out = lo;
      let hA = 0,
        hB = 0;
      while (i < mid && j < hi) {
        const a = order[i],
          b = order[j];
        if (hA > hB) {
          nextOrder[out] = a;
          nextLcp[out++] = hA;
          i++;
          if (i < mid) hA = lcp[i];
        } else if (hA < hB) {
          nextOrder[out] = b;
          nextLcp[out++] = hB;
          j++;
          if (j < hi) hB = lcp[j];
        } else {
          const h = lcpFrom(tokens, bytes, offsets, a, b, hA);
          const la = offsets[a + 1] - offsets[a],
            lb = offsets[b + 1] - offsets[b];
          // A sequence that ends first is smaller; ties (equal sequences) take the left run for stability.
          const aFirst = h === la ? true : h === lb ? false : tokens[offsets[a] + h] < tokens[offsets[b] + h];
          if (aFirst) {
            nextOrder[out] = a;
            nextLcp[out++] = hA;
            i++;
            hB = h;
            if (i < mid) hA = lcp[i];
          } else {
            nextOrder[out] = b;
            nextLcp[out++] = hB;
            j++;
            hA = h;
            if (j < hi) hB = lcp[j];
          }
        }
      }
      // The first element of a leftover run carries its LCP with the last written element, the rest keep theirs.
      if (i < mid) {
        nextOrder.set(order.subarray(i, mid), out);
        nextLcp.set(lcp.subarray(i, mid), out);
        nextLcp[out] = hA;
        out += mid - i;
      }
      if (j < hi) {
        nextOrder.set(order.subarray(j, hi), out);
        nextLcp.set(lcp.subarray(j, hi), out);
        nextLcp[out] = hB;
      }
    }
    [order, nextOrder] = [nextOrder, order];
    [lcp, nextLcp] = [nextLcp, lcp];
  }
  if (S > 0) lcp[0] = 0;
  return { order, lcp };
}

/** Builds every forest array of the contract from CSR sequences. */
export function packForest(seqs: Sequences): Forest {
  validateSequences(seqs);
  return layoutForest(seqs, sortSequences(seqs));
}

/**
 * Lays out the forest from checked sequences already sorted, with their adjacent LCPs (see sortSequences): the js
 * backend's packForest kernel.
 */
export function layoutForest(seqs: Sequences, sorted: { order: Int32Array; lcp: Int32Array }): Forest {
  const { tokens, offsets } = seqs;
  const { order, lcp } = sorted;
  const S = offsets.length - 1;
  const M = offsets[S];
  let N = 0,
    maxLen = 0;
  for (let k = 0; k < S; k++) {
    const s = order[k];
    N += offsets[s + 1] - offsets[s] - lcp[k];
    maxLen = Math.max(maxLen, offsets[s + 1] - offsets[s]);
  }
  // A node's position, parent, first subtree_end and seq_positions entry are runs of consecutive integers: copied
  // out of one iota, as typed-array set() copies at memcpy speed where a JS loop stores one element at a time.
  const iota = new Int32Array(Math.max(N, maxLen) + 1);
  for (let i = 0; i < iota.length; i++) iota[i] = i;
  const input_ids = new Int32Array(N);
  const position_ids = new Int32Array(N);
  const parent = new Int32Array(N);
  const subtree_end = new Int32Array(N);
  const seq_positions = new Int32Array(M);
  let pos = 0;
  let prevStart = 0; // where the previous sorted sequence's positions start in seq_positions
  for (let k = 0; k < S; k++) {
    const s = order[k];
    const start = offsets[s],
      len = offsets[s + 1] - start,
      h = lcp[k];
    // The shared prefix reuses the previous sorted sequence's nodes.
    if (h > 0) seq_positions.copyWithin(start, prevStart, prevStart + h);
    // Sequence k adds the chain of nodes pos .. pos + fresh - 1, one per token past the shared prefix.
    const fresh = len - h;
    if (fresh > 0) {
      input_ids.set(tokens.subarray(start + h, start + len), pos);
      position_ids.set(iota.subarray(h, len), pos);
      parent[pos] = h > 0 ? seq_positions[start + h - 1] : -1;
      parent.set(iota.subarray(pos, pos + fresh - 1), pos + 1);
      subtree_end.set(iota.subarray(pos + 1, pos + fresh + 1), pos);
      seq_positions.set(iota.subarray(pos, pos + fresh), start + h);
      pos += fresh;
    }
    prevStart = start;
  }
  // Children follow their parent in preorder, so one backward pass finalises every subtree before its parent.
  for (let p = N - 1; p >= 0; p--) {
    const q = parent[p];
    if (q >= 0 && subtree_end[p] > subtree_end[q]) subtree_end[q] = subtree_end[p];
  }
  return { input_ids, position_ids, parent, subtree_end, seq_offsets: offsets.slice(), seq_positions };
}
