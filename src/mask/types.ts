/**
 * The mask lowerings of the packed micro-batch (docs/design.md §3). Every lowering is derived from one O(N)
 * predicate: query q may attend to key k iff `k <= q < subtree_end[k]` (k is q or an ancestor of q).
 */
import type { Forest } from '../pack/contract.js';

/** What every lowering reads: the tree of a packed micro-batch. */
export type TreeArrays = Pick<Forest, 'parent' | 'subtree_end'>;

/**
 * FlexAttention `BlockMask` layout for one sequence of N packed tokens and block size B, nb = ceil(N / B) query
 * and kv blocks. Row i of an [nb, nb] index array lists, in ascending order, the kv blocks of query block i; only
 * the first `*_num_blocks[i]` entries count, the rest is 0. A *full* block is a B×B tile whose every pair is
 * visible (FlexAttention skips mask_mod there); a *partial* block has some but not all pairs visible. Positions
 * past N count as masked, as in torch's `create_block_mask`, so a tile cut by N is never full.
 */
export interface BlockMask {
  block_size: number;
  num_blocks: number; // nb
  block_kv_num_blocks: Int32Array; // [nb]
  block_kv_indices: Int32Array; // [nb, nb]
  block_full_kv_num_blocks: Int32Array; // [nb]
  block_full_kv_indices: Int32Array; // [nb, nb]
}

/** Columns of a range slice, one int32 row [K, 5] per slice (MagiAttention's `(q_range, k_range, mask type)`). */
export const SLICE_COLUMNS = ['q_start', 'q_end', 'k_start', 'k_end', 'kind'] as const;
/** Slice kinds, numbered as MagiAttention's attn_type_map: every pair visible, or `k <= q` (q and k ranges equal). */
export const SLICE_FULL = 0;
/** Slice kind: `k <= q` within the slice (q and k ranges equal). */
export const SLICE_CAUSAL = 1;

/** The block size of a block mask when none is given (FlexAttention's default). */
export const DEFAULT_BLOCK_SIZE = 128;

/** The mask ops of the backend registry. */
export type MaskOp = 'maskDense' | 'maskBits' | 'maskBlocks' | 'maskSlices' | 'maskCuSeqlens';

/** The lowerings a micro-batch file can carry (`treepack pack --masks block:128,slices`). */
export type MaskSpec = { kind: 'blocks'; blockSize: number } | { kind: 'slices' } | { kind: 'cu_seqlens' };
