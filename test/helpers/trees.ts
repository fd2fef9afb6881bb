/** Packed-forest tree arrays for mask tests: random preorder shapes straight from a seed, and brute-force oracles. */
import type { TreeArrays } from '../../src/mask/types.js';
import { packForest } from '../../src/pack/forest.js';
import { csr, randomBatch, rng } from './sequences.js';

/** subtree_end from parent by the backward pass of src/pack/forest.ts (parents precede children). */
export function subtreeEnds(parent: Int32Array): Int32Array {
  const se = new Int32Array(parent.length);
  for (let p = 0; p < parent.length; p++) se[p] = p + 1;
  for (let p = parent.length - 1; p >= 0; p--) if (parent[p] >= 0 && se[p] > se[parent[p]]) se[parent[p]] = se[p];
  return se;
}

/**
 * A random forest of N nodes in DFS preorder: node p hangs under a node of the current root-to-(p-1) path, after
 * popping a geometric number of levels (`pop` = probability of popping one more; 0 gives one chain, 1 a forest of
 * single nodes), or starts a new root with probability `root`.
 */
export function randomTree(seed: number, N: number, opts: { pop?: number; root?: number } = {}): TreeArrays {
  const r = rng(seed);
  const pop = opts.pop ?? 0.3,
    root = opts.root ?? 0.01;
  const parent = new Int32Array(N);
  const path = new Int32Array(N);
  let depth = 0;
  for (let p = 0; p < N; p++) {
    if (r() < root) depth = 0;
    else while (depth > 0 && r() < pop) depth--;
    parent[p] = depth > 0 ? path[depth - 1] : -1;
    path[depth++] = p;
  }
  return { parent, subtree_end: subtreeEnds(parent) };
}

/** k is q or an ancestor of q, by walking parent pointers: independent of subtree_end. */
export function ancestorOracle(parent: Int32Array): (q: number, k: number) => boolean {
  return (q, k) => {
    for (let x = q; x >= 0; x = parent[x]) if (x === k) return true;
    return false;
  };
}

export const packed = (seqs: number[][]): TreeArrays => packForest(csr(seqs));

/** Named small forests: the edge cases of the contract plus random shapes. */
export function smallForests(): [string, TreeArrays][] {
  const cases: [string, TreeArrays][] = [
    ['empty batch', packed([])],
    ['empty sequences only', packed([[], []])],
    ['one token', packed([[7]])],
    [
      'duplicates',
      packed([
        [1, 2, 3],
        [1, 2, 3],
        [1, 2, 3],
      ]),
    ],
    ['a sequence that is a prefix of another', packed([[1, 2], [1, 2, 3, 4], [1]])],
    ['deep chain', packed([Array.from({ length: 300 }, (_, i) => i % 5)])],
    ['wide fan-out', packed(Array.from({ length: 200 }, (_, i) => [9, i]))],
    ['roots only', packed(Array.from({ length: 150 }, (_, i) => [i]))],
  ];
  for (let seed = 1; seed <= 12; seed++) cases.push([`random batch ${seed}`, packed(randomBatch(seed, { count: 30, maxLen: 20 }))]);
  for (const [i, pop] of [0, 0.05, 0.3, 0.8, 1].entries()) cases.push([`random tree pop=${pop}`, randomTree(100 + i, 333, { pop })]);
  return cases;
}
