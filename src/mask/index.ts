/**
 * The mask lowerings of the packed micro-batch: the js references (each checks its input, then runs its kernel),
 * their types, and the checks every backend shares. Running them on a backend is src/backend/ops.ts; their form in
 * micro-batch files is src/io/masks.ts.
 */
export * from './types.js';
export { maskDense, maskBits } from './dense.js';
export { maskBlocks } from './blocks.js';
export { maskSlices } from './slices.js';
export { maskCuSeqlens } from './cuseqlens.js';
export { numBlocks, blockMaskBytes, bitsWordsPerRow, bitsBytes, denseBytes } from './sizes.js';
export { validateTree } from './validate.js';
