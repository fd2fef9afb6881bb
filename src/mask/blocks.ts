/**
 * Block-sparse lowering (FlexAttention BlockMask layout, see BlockMask in types.ts) in O(N + nb²).
 *
 * For kv block j and query block i > j every key precedes every query, so pair (q, k) is visible iff
 * q < subtree_end[k]. With lo_j / hi_j the least / greatest subtree_end over the keys of block j:
 *   some pair visible  ⟺ i·B < hi_j           ⟺ i < ceil(hi_j / B)
 *   every pair visible ⟺ (i+1)·B <= lo_j       ⟺ i < floor(lo_j / B)   (subtree_end <= N: the tile is whole)
 * so each kv block is full for one run of query blocks and partial for the next. On the diagonal (i = j) the
 * self pairs are visible and, for B > 1, the pair (first query, second key) is not: partial, and full for B = 1.
 */
import { numBlocks } from './sizes.js';
import { DEFAULT_BLOCK_SIZE, type BlockMask, type TreeArrays } from './types.js';
import { checkMaskCall, hostLimits } from './validate.js';

export { blockMaskBytes, numBlocks } from './sizes.js';

/** The block-sparse tree mask in FlexAttention's BlockMask layout (docs/reference/format.md). */
export function maskBlocks(tree: TreeArrays, blockSize: number = DEFAULT_BLOCK_SIZE): BlockMask {
  checkMaskCall('maskBlocks', tree, blockSize, hostLimits('js'));
  return lowerBlocks(tree, blockSize);
}

/** The js kernel of maskBlocks: `tree` and `B` already checked. */
export function lowerBlocks(tree: TreeArrays, B: number): BlockMask {
  const N = tree.parent.length;
  const se = tree.subtree_end;
  const nb = numBlocks(N, B);
  const kvNum = new Int32Array(nb),
    kvIdx = new Int32Array(nb * nb);
  const fullNum = new Int32Array(nb),
    fullIdx = new Int32Array(nb * nb);
  for (let j = 0; j < nb; j++) {
    let lo = N,
      hi = 0;
    for (let k = j * B, end = Math.min(N, k + B); k < end; k++) {
      const e = se[k];
      if (e < lo) lo = e;
      if (e > hi) hi = e;
    }
    // Columns are visited in ascending j, so appending keeps every row ascending.
    if (B === 1) fullIdx[j * nb + fullNum[j]++] = j;
    else kvIdx[j * nb + kvNum[j]++] = j;
    const fullEnd = Math.floor(lo / B),
      anyEnd = Math.min(nb, Math.ceil(hi / B));
    let i = j + 1;
    for (; i < fullEnd; i++) fullIdx[i * nb + fullNum[i]++] = j;
    for (; i < anyEnd; i++) kvIdx[i * nb + kvNum[i]++] = j;
  }
  return {
    block_size: B,
    num_blocks: nb,
    block_kv_num_blocks: kvNum,
    block_kv_indices: kvIdx,
    block_full_kv_num_blocks: fullNum,
    block_full_kv_indices: fullIdx,
  };
}
