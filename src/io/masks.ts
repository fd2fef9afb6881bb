/**
 * The form mask lowerings take in micro-batch files (`treepack pack --masks block:128,slices`): tensor names,
 * shapes and the `block_size` header key. The lowerings are built through the backend registry.
 */
import { lowerMasks, type BackendName } from '../backend/index.js';
import type { MaskSpec, TreeArrays } from '../mask/types.js';
import type { Tensor } from './safetensors.js';

export interface MaskTensors {
  tensors: Map<string, Tensor>;
  /** Extra header metadata: `block_size` when a block mask is present. */
  metadata: Record<string, string>;
  /** Per lowering, which backend built it and why. */
  reports: string[];
}

/** Builds the lowerings of `specs` on the best available backend (or `backend`), as micro-batch tensors. */
export async function maskTensors(tree: TreeArrays, specs: readonly MaskSpec[], backend?: BackendName | 'auto'): Promise<MaskTensors> {
  const { blocks, slices, cuSeqlens, reports } = await lowerMasks(tree, specs, backend);
  const tensors = new Map<string, Tensor>();
  const metadata: Record<string, string> = {};
  if (blocks) {
    const nb = blocks.num_blocks;
    tensors.set('block_kv_num_blocks', { dtype: 'I32', shape: [nb], data: blocks.block_kv_num_blocks });
    tensors.set('block_kv_indices', { dtype: 'I32', shape: [nb, nb], data: blocks.block_kv_indices });
    tensors.set('block_full_kv_num_blocks', { dtype: 'I32', shape: [nb], data: blocks.block_full_kv_num_blocks });
    tensors.set('block_full_kv_indices', { dtype: 'I32', shape: [nb, nb], data: blocks.block_full_kv_indices });
    metadata.block_size = String(blocks.block_size);
  }
  if (slices) tensors.set('slices', { dtype: 'I32', shape: [slices.length / 5, 5], data: slices });
  if (cuSeqlens) tensors.set('cu_seqlens', { dtype: 'I32', shape: [cuSeqlens.length], data: cuSeqlens });
  return { tensors, metadata, reports };
}
