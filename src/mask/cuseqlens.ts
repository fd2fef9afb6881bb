/**
 * cu_seqlens (flash-attn varlen) for a forest with no sharing: every node has at most one child, so the packed
 * stream is independent chains and the tree mask is block-diagonal causal. int32 [R + 1] for R roots.
 */
import { TreepackError } from '../errors.js';
import { validateTree } from './validate.js';
import type { TreeArrays } from './types.js';

/** Throws, naming the first node with a second child, unless every node has at most one (every backend's check). */
export function checkNoSharing(parent: Int32Array): void {
  for (let p = 0; p < parent.length; p++) {
    if (parent[p] >= 0 && parent[p] !== p - 1) {
      throw new TreepackError('E_INPUT', `cu_seqlens needs a forest with no sharing, but node ${parent[p]} has more than one child; use the block-sparse or slices lowering`, { field: 'parent' });
    }
  }
}

export function maskCuSeqlens(tree: TreeArrays): Int32Array {
  const N = validateTree(tree);
  const { parent } = tree;
  checkNoSharing(parent);
  let roots = 0;
  for (let p = 0; p < N; p++) if (parent[p] < 0) roots++;
  const out = new Int32Array(roots + 1);
  let r = 0;
  for (let p = 1; p < N; p++) if (parent[p] < 0) out[++r] = p;
  if (N > 0) out[roots] = N;
  return out;
}
