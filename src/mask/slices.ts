/**
 * Range slices (MagiAttention style), int32 [K, 5] rows `(q_start, q_end, k_start, k_end, kind)`, in O(N + K).
 *
 * A radix run is a maximal chain [a, b) of positions each the only child of the one before. Its queries see
 * themselves causally, one CAUSAL slice (a, b, a, b), and every ancestor of a in full: the runs on the path from
 * the root, which lie at ascending positions, merged into maximal contiguous ranges, one FULL slice each. A FULL
 * slice to the same key range as the previous sibling's, whose q range ends at a, is extended instead of repeated
 * (a wide fan-out of leaves under one prefix is one slice). Every visible pair is in exactly one slice.
 */
import { SLICE_CAUSAL, SLICE_FULL, type TreeArrays } from './types.js';
import { checkMaskCall, hostLimits } from './validate.js';

class SliceList {
  data = new Int32Array(5 * 64);
  count = 0;
  push(qs: number, qe: number, ks: number, ke: number, kind: number): number {
    if (5 * (this.count + 1) > this.data.length) {
      const grown = new Int32Array(this.data.length * 2);
      grown.set(this.data);
      this.data = grown;
    }
    const d = this.data,
      o = 5 * this.count;
    d[o] = qs;
    d[o + 1] = qe;
    d[o + 2] = ks;
    d[o + 3] = ke;
    d[o + 4] = kind;
    return this.count++;
  }
}

/** The tree mask as MagiAttention range slices: int32 [K, 5] rows (q_start, q_end, k_start, k_end, kind). */
export function maskSlices(tree: TreeArrays): Int32Array {
  checkMaskCall('maskSlices', tree, undefined, hostLimits('js'));
  return lowerSlices(tree);
}

/** The js kernel of maskSlices: `tree` already checked. */
export function lowerSlices(tree: TreeArrays): Int32Array {
  const N = tree.parent.length;
  const { parent, subtree_end: se } = tree;
  const out = new SliceList();
  // The path from the root to the current run: its runs, and their ancestor ranges merged (with, per range, the
  // last FULL slice emitted to it, the candidate for extension).
  const runStart = new Int32Array(N),
    runEnd = new Int32Array(N);
  const rangeStart = new Int32Array(N),
    rangeEnd = new Int32Array(N),
    rangeSlice = new Int32Array(N);
  let runs = 0,
    ranges = 0;
  for (let a = 0; a < N;) {
    let b = a + 1;
    while (b < N && parent[b] === b - 1 && se[b] === se[b - 1]) b++;
    const x = parent[a];
    while (runs > 0 && !(runStart[runs - 1] <= x && x < runEnd[runs - 1])) {
      const s = runStart[--runs];
      if (rangeStart[ranges - 1] === s) ranges--;
      else rangeEnd[ranges - 1] = s;
    }
    const d = out.data;
    for (let g = 0; g < ranges; g++) {
      const s = rangeSlice[g];
      if (s >= 0 && d[5 * s + 1] === a && d[5 * s + 2] === rangeStart[g] && d[5 * s + 3] === rangeEnd[g]) d[5 * s + 1] = b;
      else rangeSlice[g] = out.push(a, b, rangeStart[g], rangeEnd[g], SLICE_FULL);
    }
    out.push(a, b, a, b, SLICE_CAUSAL);
    runStart[runs] = a;
    runEnd[runs++] = b;
    if (ranges > 0 && rangeEnd[ranges - 1] === a) rangeEnd[ranges - 1] = b;
    else {
      rangeStart[ranges] = a;
      rangeEnd[ranges] = b;
      rangeSlice[ranges++] = -1;
    }
    a = b;
  }
  return out.data.slice(0, 5 * out.count);
}
