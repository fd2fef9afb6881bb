/**
 * The mask lowerings on CUDA (native/cuda/mask.cu through the CUDA addon), on the first GPU; input checked and
 * outputs sized against the device's memory by the dispatch layer (ops.ts, with the cuda entry's limits). Each
 * call reports its kernels' own time (cudaEvent) to `timeKernels`.
 */
import { TreepackError } from '../errors.js';
import { numBlocks } from '../mask/sizes.js';
import type { BlockMask, TreeArrays } from '../mask/types.js';
import { loadCuda, type CudaBinding } from './native.js';
import { reportKernelMs } from './profile.js';

function binding(): CudaBinding {
  const loaded = loadCuda();
  if ('error' in loaded) throw new TreepackError('E_BACKEND', `cuda backend unavailable: ${loaded.error}`);
  return loaded.binding;
}

function timed<T>(out: { data: T; kernelMs: number }): T {
  reportKernelMs(out.kernelMs);
  return out.data;
}

export async function maskDenseCuda(tree: TreeArrays): Promise<Uint8Array> {
  return timed(binding().maskDense(tree.parent, tree.subtree_end));
}

export async function maskBitsCuda(tree: TreeArrays): Promise<Uint32Array> {
  return timed(binding().maskBits(tree.parent, tree.subtree_end));
}

export async function maskBlocksCuda(tree: TreeArrays, B: number): Promise<BlockMask> {
  return { block_size: B, num_blocks: numBlocks(tree.parent.length, B), ...timed(binding().maskBlocks(tree.subtree_end, B)) };
}
