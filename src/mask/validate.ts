/**
 * Checks every backend relies on before it touches the tree: the kernels (C++, CUDA, WGSL) index with these
 * values and re-check only what keeps them memory-safe.
 */
import { argError, TreepackError } from '../errors.js';
import { treeViolations } from '../pack/invariants.js';
import type { TreeArrays } from './types.js';

/**
 * `parent` and `subtree_end` are Int32Arrays of one length N, parents precede children, the layout is a DFS
 * preorder and subtree_end agrees with parent. O(N). Returns N.
 */
export function validateTree(tree: TreeArrays): number {
  if (tree === null || typeof tree !== 'object') throw argError('tree', 'an object {parent, subtree_end}', tree);
  const { parent, subtree_end } = tree;
  if (!(parent instanceof Int32Array)) throw argError('parent', 'an Int32Array', parent);
  if (!(subtree_end instanceof Int32Array)) throw argError('subtree_end', 'an Int32Array', subtree_end);
  if (subtree_end.length !== parent.length) {
    throw new TreepackError('E_INPUT', `subtree_end has ${subtree_end.length} elements but parent has N = ${parent.length}`, { field: 'subtree_end' });
  }
  const bad = treeViolations(parent, subtree_end);
  if (bad.length) {
    const field = bad[0].startsWith('parent') ? 'parent' : 'subtree_end';
    throw new TreepackError('E_INPUT', `not a packed forest: ${bad.slice(0, 3).join('; ')}${bad.length > 3 ? '; …' : ''}`, { field });
  }
  return parent.length;
}

export function validateBlockSize(blockSize: unknown): number {
  if (typeof blockSize !== 'number' || !Number.isSafeInteger(blockSize) || blockSize < 1 || blockSize > 1 << 20) {
    throw argError('block_size', 'an integer in [1, 2^20]', blockSize);
  }
  return blockSize;
}

/** A lowering whose output would exceed `maxBytes` on `backend` is refused before anything is allocated. */
export function checkBytes(what: string, bytes: number, maxBytes: number, backend: string, N: number): void {
  if (bytes > maxBytes) {
    throw new TreepackError(
      'E_LIMIT',
      `${what} for N = ${N} needs ${bytes} bytes, over the ${backend} limit of ${maxBytes} bytes; use the block-sparse or slices lowering, or a smaller micro-batch`,
    );
  }
}
