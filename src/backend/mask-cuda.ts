/**
 * The mask lowerings on CUDA (native/cuda/mask.cu through the CUDA addon): validation and limits here, the work
 * on the first GPU. Outputs must fit in the device's memory and in a host typed array.
 */
import { TreepackError } from '../errors.js';
import { blockMaskBytes, MAX_BLOCK_MASK_BYTES, numBlocks } from '../mask/blocks.js';
import { bitsBytes, denseBytes, MAX_DENSE_BYTES } from '../mask/dense.js';
import type { BlockMask, TreeArrays } from '../mask/types.js';
import { checkBytes, validateBlockSize, validateTree } from '../mask/validate.js';
import { cudaDeviceInfo, loadCuda, type CudaBinding } from './native.js';

function device(): { binding: CudaBinding; maxBytes: number } {
  const info = cudaDeviceInfo();
  if (!info.available) throw new TreepackError('E_BACKEND', `cuda backend unavailable: ${info.reason}`);
  const loaded = loadCuda();
  if ('error' in loaded) throw new TreepackError('E_BACKEND', `cuda backend unavailable: ${loaded.error}`);
  return { binding: loaded.binding, maxBytes: Math.min(info.devices[0].totalGlobalMem / 2, MAX_DENSE_BYTES) };
}

export function maskDenseCuda(tree: TreeArrays): Uint8Array {
  const N = validateTree(tree);
  const { binding, maxBytes } = device();
  checkBytes('a dense mask', denseBytes(N), maxBytes, 'cuda', N);
  return binding.maskDense(tree.subtree_end).data;
}

export function maskBitsCuda(tree: TreeArrays): Uint32Array {
  const N = validateTree(tree);
  const { binding, maxBytes } = device();
  checkBytes('a bitmask', bitsBytes(N), maxBytes, 'cuda', N);
  return binding.maskBits(tree.subtree_end).data;
}

/** The block mask and the time its kernels took on the GPU (the bench's figure for the CUDA goal). */
export function maskBlocksCudaTimed(tree: TreeArrays, blockSize: number): { mask: BlockMask; kernelMs: number } {
  const N = validateTree(tree);
  const B = validateBlockSize(blockSize);
  const { binding, maxBytes } = device();
  checkBytes('a block mask', blockMaskBytes(N, B), Math.min(maxBytes, MAX_BLOCK_MASK_BYTES), 'cuda', N);
  const { data, kernelMs } = binding.maskBlocks(tree.subtree_end, B);
  return { mask: { block_size: B, num_blocks: numBlocks(N, B), ...data }, kernelMs };
}
