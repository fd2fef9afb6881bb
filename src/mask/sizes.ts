/** Output sizes of the lowerings, which decide whether a backend can hold them (validate.ts) and the bench's figures. */

export function numBlocks(N: number, blockSize: number): number {
  return Math.ceil(N / blockSize);
}

/** Bytes of the four arrays of a block mask. */
export function blockMaskBytes(N: number, blockSize: number): number {
  const nb = numBlocks(N, blockSize);
  return 8 * nb * (nb + 1);
}

export function denseBytes(N: number): number {
  return N * N;
}

export function bitsWordsPerRow(N: number): number {
  return Math.ceil(N / 32);
}

export function bitsBytes(N: number): number {
  return N * bitsWordsPerRow(N) * 4;
}
