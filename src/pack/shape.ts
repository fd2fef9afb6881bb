/** Shape figures of a packed forest, for `treepack stats`: where branches start and how deep. */
import type { Forest } from './contract.js';

/** Bucket k counts branch points at depth in [2^(k-1), 2^k) (bucket 0: depth 0, i.e. a new root). */
export type DepthHistogram = number[];

/**
 * Branch points: every node that does not simply continue the node laid out just before it, i.e. the first
 * node of each sibling after the first and of each root after the first. In preorder these are exactly the
 * positions where parent[p] !== p - 1, so one O(N) scan finds them.
 */
export function branchDepthHistogram(f: Forest, into: DepthHistogram = []): DepthHistogram {
  const { parent, position_ids } = f;
  for (let p = 1; p < parent.length; p++) {
    if (parent[p] === p - 1) continue;
    const d = position_ids[p];
    const bucket = d === 0 ? 0 : 32 - Math.clz32(d);
    while (into.length <= bucket) into.push(0);
    into[bucket]++;
  }
  return into;
}

export function bucketLabel(k: number): string {
  if (k === 0) return '0';
  const lo = 2 ** (k - 1),
    hi = 2 ** k - 1;
  return lo === hi ? `${lo}` : `${lo}-${hi}`;
}
