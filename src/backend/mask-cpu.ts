/** The mask lowerings on the CPU addon (native/core/mask.cc); input checked by the dispatch layer (ops.ts). */
import { TreepackError } from '../errors.js';
import { numBlocks } from '../mask/sizes.js';
import type { BlockMask, TreeArrays } from '../mask/types.js';
import { loadNative, type NativeBinding } from './native.js';

function addon(): NativeBinding {
  const loaded = loadNative();
  if ('error' in loaded) throw new TreepackError('E_BACKEND', `native backend unavailable: ${loaded.error}`);
  return loaded.binding;
}

export async function maskDenseCpu(tree: TreeArrays): Promise<Uint8Array> {
  return addon().maskDense(tree.parent, tree.subtree_end);
}

export async function maskBitsCpu(tree: TreeArrays): Promise<Uint32Array> {
  return addon().maskBits(tree.parent, tree.subtree_end);
}

export async function maskBlocksCpu(tree: TreeArrays, B: number): Promise<BlockMask> {
  return { block_size: B, num_blocks: numBlocks(tree.parent.length, B), ...addon().maskBlocks(tree.subtree_end, B) };
}

export async function maskSlicesCpu(tree: TreeArrays): Promise<Int32Array> {
  return addon().maskSlices(tree.parent, tree.subtree_end);
}

export async function maskCuSeqlensCpu(tree: TreeArrays): Promise<Int32Array> {
  return addon().maskCuSeqlens(tree.parent);
}
