/**
 * The mask lowerings on CUDA (native/cuda/mask.cu through the CUDA addon), on the first GPU; input checked and
 * outputs sized against the device's memory by the dispatch layer (ops.ts, with the cuda entry's limits).
 */
import { TreepackError } from '../errors.js';
import { numBlocks } from '../mask/sizes.js';
import type { BlockMask, TreeArrays } from '../mask/types.js';
import { loadCuda, type CudaBinding } from './native.js';

function binding(): CudaBinding {
  const loaded = loadCuda();
  if ('error' in loaded) throw new TreepackError('E_BACKEND', `cuda backend unavailable: ${loaded.error}`);
  return loaded.binding;
}

export async function maskDenseCuda(tree: TreeArrays): Promise<Uint8Array> {
  return binding().maskDense(tree.parent, tree.subtree_end).data;
}

export async function maskBitsCuda(tree: TreeArrays): Promise<Uint32Array> {
  return binding().maskBits(tree.parent, tree.subtree_end).data;
}

/** The block mask and the time its kernels took on the GPU (the bench's figure for the CUDA goal). */
export function maskBlocksCudaTimed(tree: TreeArrays, B: number): { mask: BlockMask; kernelMs: number } {
  const { data, kernelMs } = binding().maskBlocks(tree.subtree_end, B);
  return { mask: { block_size: B, num_blocks: numBlocks(tree.parent.length, B), ...data }, kernelMs };
}
