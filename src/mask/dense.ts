/**
 * Dense lowerings for tests and small batches: bool [N, N] as bytes, and the same bits packed into uint32 words,
 * row-major (bit k of row q is bit k % 32 of word q * ceil(N / 32) + floor(k / 32)). Row q is row parent[q] plus
 * q itself, so each row is one copy of an earlier row: O(N²) bytes written, no per-pair test.
 */
import { checkBytes, validateTree } from './validate.js';
import type { TreeArrays } from './types.js';

/** Largest dense output the js and cpu backends allocate (typed arrays index with 32 bits). */
export const MAX_DENSE_BYTES = 2 ** 31;

export function denseBytes(N: number): number {
  return N * N;
}

export function bitsWordsPerRow(N: number): number {
  return Math.ceil(N / 32);
}

export function bitsBytes(N: number): number {
  return N * bitsWordsPerRow(N) * 4;
}

export function maskDense(tree: TreeArrays): Uint8Array {
  const N = validateTree(tree);
  checkBytes('a dense mask', denseBytes(N), MAX_DENSE_BYTES, 'js', N);
  const out = new Uint8Array(N * N);
  const { parent } = tree;
  for (let q = 0; q < N; q++) {
    const p = parent[q];
    if (p >= 0) out.copyWithin(q * N, p * N, p * N + N);
    out[q * N + q] = 1;
  }
  return out;
}

export function maskBits(tree: TreeArrays): Uint32Array {
  const N = validateTree(tree);
  checkBytes('a bitmask', bitsBytes(N), MAX_DENSE_BYTES, 'js', N);
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
