/**
 * Dense lowerings for tests and small batches: bool [N, N] as bytes, and the same bits packed into uint32 words,
 * row-major (bit k of row q is bit k % 32 of word q * ceil(N / 32) + floor(k / 32)). Row q is row parent[q] plus
 * q itself, so each row is one copy of an earlier row: O(N²) bytes written, no per-pair test.
 */
import { bitsWordsPerRow } from './sizes.js';
import type { TreeArrays } from './types.js';
import { checkMaskCall, hostLimits } from './validate.js';

export { bitsBytes, bitsWordsPerRow, denseBytes } from './sizes.js';

/** The dense tree mask, uint8 [N, N] row-major: row q, column k is 1 iff k <= q < subtree_end[k]. */
export function maskDense(tree: TreeArrays): Uint8Array {
  checkMaskCall('maskDense', tree, undefined, hostLimits('js'));
  return lowerDense(tree);
}

/** The tree mask bit-packed: uint32 [N, ceil(N/32)], bit k%32 of word k/32 of row q. */
export function maskBits(tree: TreeArrays): Uint32Array {
  checkMaskCall('maskBits', tree, undefined, hostLimits('js'));
  return lowerBits(tree);
}

/** The js kernel of maskDense: `tree` already checked (checkMaskCall). */
export function lowerDense(tree: TreeArrays): Uint8Array {
  const N = tree.parent.length;
  const out = new Uint8Array(N * N);
  const { parent } = tree;
  for (let q = 0; q < N; q++) {
    const p = parent[q];
    if (p >= 0) out.copyWithin(q * N, p * N, p * N + N);
    out[q * N + q] = 1;
  }
  return out;
}

/** The js kernel of maskBits: `tree` already checked. */
export function lowerBits(tree: TreeArrays): Uint32Array {
  const N = tree.parent.length;
  const W = bitsWordsPerRow(N);
  const out = new Uint32Array(N * W);
  const { parent } = tree;
  for (let q = 0; q < N; q++) {
    const p = parent[q];
    if (p >= 0) out.copyWithin(q * W, p * W, p * W + W);
    out[q * W + (q >>> 5)] |= 1 << (q & 31);
  }
  return out;
}
