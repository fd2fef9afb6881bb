/**
 * cu_seqlens (flash-attn varlen) for a forest with no sharing: every node has at most one child, so the packed
 * stream is independent chains and the tree mask is block-diagonal causal. int32 [R + 1] for R roots.
 */
import type { TreeArrays } from './types.js';
import { checkMaskCall, hostLimits } from './validate.js';

/** flash-attn varlen offsets of a forest with no sharing (every node at most one child); E_INPUT otherwise. */
export function maskCuSeqlens(tree: TreeArrays): Int32Array {
  checkMaskCall('maskCuSeqlens', tree, undefined, hostLimits('js'));
  return lowerCuSeqlens(tree);
}

/** The js kernel of maskCuSeqlens: `tree` already checked, sharing included (checkNoSharing). */
export function lowerCuSeqlens(tree: TreeArrays): Int32Array {
  const { parent } = tree;
  const N = parent.length;
  let roots = 0;
  for (let p = 0; p < N; p++) if (parent[p] < 0) roots++;
  const out = new Int32Array(roots + 1);
  let r = 0;
  for (let p = 1; p < N; p++) if (parent[p] < 0) out[++r] = p;
  if (N > 0) out[roots] = N;
  return out;
}
