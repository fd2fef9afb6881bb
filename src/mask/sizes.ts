/**
 * Output sizes of the lowerings, which decide whether a backend can hold them (validate.ts). Public so a caller can
 * choose a lowering that fits its memory before building it: the dense forms are quadratic in N.
 */

export function numBlocks(N: number, blockSize: number): number {
  return Math.ceil(N / blockSize);
}

/** Bytes of the four arrays of a block mask. */
export function blockMaskBytes(N: number, blockSize: number): number {
  const nb = numBlocks(N, blockSize);
  return 8 * nb * (nb + 1);
}

/** Bytes of the dense mask (one byte per query/key pair). */
export function denseBytes(N: number): number {
  return N * N;
}

/** 32-bit words per row of the bit-packed mask. */
export function bitsWordsPerRow(N: number): number {
  return Math.ceil(N / 32);
}

/** Bytes of the bit-packed dense mask (one bit per pair, rows padded to 32-bit words). */
export function bitsBytes(N: number): number {
  return N * bitsWordsPerRow(N) * 4;
}
