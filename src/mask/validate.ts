/**
 * Checks every backend relies on before it touches the tree, run once per call by the dispatch layer
 * (src/backend/ops.ts) or by the js references below: the kernels (C++, CUDA, WGSL) index with these values and
 * re-check only what keeps them memory-safe.
 */
import { argError, TreepackError } from '../errors.js';
import { treeViolations } from '../pack/invariants.js';
import { bitsBytes, blockMaskBytes, denseBytes, numBlocks } from './sizes.js';
import type { MaskOp, TreeArrays } from './types.js';

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
    throw new TreepackError('E_INPUT', `subtree_end has ${subtree_end.length} elements but parent has N = ${parent.length}`, {
      field: 'subtree_end',
    });
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

/** Throws, naming the first node with a second child, unless every node has at most one (cu_seqlens' precondition). */
export function checkNoSharing(parent: Int32Array): void {
  for (let p = 0; p < parent.length; p++) {
    if (parent[p] >= 0 && parent[p] !== p - 1) {
      throw new TreepackError(
        'E_INPUT',
        `cu_seqlens needs a forest with no sharing, but node ${parent[p]} has more than one child; use the block-sparse or slices lowering`,
        { field: 'parent' },
      );
    }
  }
}

/**
 * How much output one backend can allocate for a call: the largest single array and the largest total, each with
 * the name of what imposes it (quoted in E_LIMIT errors). A backend entry's `limits()` (src/backend/registry.ts).
 */
export interface OutputLimits {
  maxArrayBytes: number;
  arrayLimit: string;
  maxTotalBytes: number;
  totalLimit: string;
}

/** Typed arrays index with 32 bits: the js and cpu backends allocate at most 2 GiB per lowering. */
export function hostLimits(backend: string): OutputLimits {
  return { maxArrayBytes: 2 ** 31, arrayLimit: backend, maxTotalBytes: 2 ** 31, totalLimit: backend };
}

/** A lowering whose output would exceed `maxBytes` is refused before anything is allocated. */
function checkBytes(what: string, bytes: number, maxBytes: number, limit: string, N: number): void {
  if (bytes > maxBytes) {
    throw new TreepackError(
      'E_LIMIT',
      `${what} for N = ${N} needs ${bytes} bytes, over the ${limit} limit of ${maxBytes} bytes; use the block-sparse or slices lowering, or a smaller micro-batch`,
    );
  }
}

/** Output sizes of the quadratic lowerings: [what, total bytes, bytes of the largest array, what that array is]. */
function outputBytes(op: MaskOp, N: number, B: number): [string, number, number, string] | undefined {
  switch (op) {
    case 'maskDense':
      return ['a dense mask', denseBytes(N), denseBytes(N), 'a dense mask'];
    case 'maskBits':
      return ['a bitmask', bitsBytes(N), bitsBytes(N), 'a bitmask'];
    case 'maskBlocks': {
      const nb = numBlocks(N, B);
      return ['a block mask', blockMaskBytes(N, B), 4 * nb * nb, 'a block mask index array'];
    }
    default:
      return undefined; // slices and cu_seqlens are O(N)
  }
}

/**
 * Everything a mask op checks before any backend runs it: the tree, the block size (maskBlocks), no sharing
 * (maskCuSeqlens), and the output against `limits`. Returns N.
 */
export function checkMaskCall(op: MaskOp, tree: TreeArrays, blockSize: number | undefined, limits: OutputLimits): number {
  const N = validateTree(tree);
  const B = op === 'maskBlocks' ? validateBlockSize(blockSize) : 0;
  if (op === 'maskCuSeqlens') checkNoSharing(tree.parent);
  const out = outputBytes(op, N, B);
  if (out) {
    checkBytes(out[0], out[1], limits.maxTotalBytes, limits.totalLimit, N);
    checkBytes(out[3], out[2], limits.maxArrayBytes, limits.arrayLimit, N);
  }
  return N;
}
