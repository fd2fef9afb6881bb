/** The mask lowerings on the CPU addon (native/core/mask.cc): validation and limits here, the work in C++. */
import { TreepackError } from '../errors.js';
import { blockMaskBytes, MAX_BLOCK_MASK_BYTES, numBlocks } from '../mask/blocks.js';
import { checkNoSharing } from '../mask/cuseqlens.js';
import { bitsBytes, denseBytes, MAX_DENSE_BYTES } from '../mask/dense.js';
import type { BlockMask, TreeArrays } from '../mask/types.js';
import { checkBytes, validateBlockSize, validateTree } from '../mask/validate.js';
import { loadNative, type NativeBinding } from './native.js';

function addon(): NativeBinding {
  const loaded = loadNative();
  if ('error' in loaded) throw new TreepackError('E_BACKEND', `native backend unavailable: ${loaded.error}`);
  return loaded.binding;
}

export function maskDenseCpu(tree: TreeArrays): Uint8Array {
  const N = validateTree(tree);
  checkBytes('a dense mask', denseBytes(N), MAX_DENSE_BYTES, 'cpu', N);
  return addon().maskDense(tree.parent, tree.subtree_end);
}

export function maskBitsCpu(tree: TreeArrays): Uint32Array {
  const N = validateTree(tree);
  checkBytes('a bitmask', bitsBytes(N), MAX_DENSE_BYTES, 'cpu', N);
  return addon().maskBits(tree.parent, tree.subtree_end);
}

export function maskBlocksCpu(tree: TreeArrays, blockSize: number): BlockMask {
  const N = validateTree(tree);
  const B = validateBlockSize(blockSize);
  checkBytes('a block mask', blockMaskBytes(N, B), MAX_BLOCK_MASK_BYTES, 'cpu', N);
  return { block_size: B, num_blocks: numBlocks(N, B), ...addon().maskBlocks(tree.subtree_end, B) };
}

export function maskSlicesCpu(tree: TreeArrays): Int32Array {
  validateTree(tree);
  return addon().maskSlices(tree.parent, tree.subtree_end);
}

export function maskCuSeqlensCpu(tree: TreeArrays): Int32Array {
  validateTree(tree);
  checkNoSharing(tree.parent);
  return addon().maskCuSeqlens(tree.parent);
}
