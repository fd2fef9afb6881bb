/**
 * The js mask lowerings (the reference every backend is held to) against the ancestor relation walked through
 * parent pointers, on random forests, packed batches and the edge cases; and their handling of bad input.
 */
import { describe, expect, it } from 'vitest';
import { TreepackError } from '../src/errors.js';
import { maskBlocks } from '../src/mask/blocks.js';
import { maskCuSeqlens } from '../src/mask/cuseqlens.js';
import { maskBits, maskDense } from '../src/mask/dense.js';
import { parseMaskSpecs } from '../src/io/masks.js';
import { maskSlices } from '../src/mask/slices.js';
import type { TreeArrays } from '../src/mask/types.js';
import { caught } from './helpers/errors.js';
import { blockMaskProblem, sliceCoverage } from './helpers/masks.js';
import { ancestorOracle, packed, randomTree, smallForests } from './helpers/trees.js';

describe('mask lowerings (js) equal the ancestor relation', () => {
  for (const [name, tree] of smallForests()) {
    it(name, () => {
      const N = tree.parent.length;
      const visible = ancestorOracle(tree.parent);
      const dense = maskDense(tree);
      const bits = maskBits(tree);
      const W = Math.ceil(N / 32);
      const cover = sliceCoverage(maskSlices(tree), N);
      let bad = 0;
      for (let q = 0; q < N; q++) {
        for (let k = 0; k < N; k++) {
          const v = visible(q, k) ? 1 : 0;
          const bit = (bits[q * W + (k >>> 5)] >>> (k & 31)) & 1;
          if (dense[q * N + k] !== v || bit !== v || cover[q * N + k] !== v) bad++;
        }
      }
      expect(bad).toBe(0);
      for (const B of [1, 2, 3, 16, 64, 128]) expect(blockMaskProblem(maskBlocks(tree, B), N, visible), `B = ${B}`).toBe('');
    });
  }

  it('bits past N in a row stay 0', () => {
    const tree = randomTree(5, 45);
    const bits = maskBits(tree);
    for (let q = 0; q < 45; q++) expect(bits[q * 2 + 1] >>> 13).toBe(0);
  });

  it('slices: one causal slice per radix run, ancestors merged, fan-out leaves share one full slice', () => {
    // Prefix [5, 6] (one run), then 3 leaf children 1, 2, 3: queries 2..4 all see keys 0..1 through one slice.
    expect(
      Array.from(
        maskSlices(
          packed([
            [5, 6, 1],
            [5, 6, 2],
            [5, 6, 3],
          ]),
        ),
      ),
    ).toEqual([0, 2, 0, 2, 1, 2, 5, 0, 2, 0, 2, 3, 2, 3, 1, 3, 4, 3, 4, 1, 4, 5, 4, 5, 1]);
    // Nodes 1 2 | 3 | 4, 8 | 9: runs [0,2) [2,3) [3,4) [4,5) [5,6). Leaves 3 and 4 under node 2 see the merged
    // ancestor range [0,3) through one slice; 9, under node 1, sees [0,2).
    const s = maskSlices(
      packed([
        [1, 2, 3, 4],
        [1, 2, 9],
        [1, 2, 3, 8],
      ]),
    );
    expect(Array.from(s)).toEqual([
      0, 2, 0, 2, 1, 2, 3, 0, 2, 0, 2, 3, 2, 3, 1, 3, 5, 0, 3, 0, 3, 4, 3, 4, 1, 4, 5, 4, 5, 1, 5, 6, 0, 2, 0, 5, 6, 5, 6, 1,
    ]);
  });

  it('cu_seqlens for forests with no sharing, and a clear error otherwise', () => {
    expect(Array.from(maskCuSeqlens(packed([])))).toEqual([0]);
    expect(Array.from(maskCuSeqlens(packed([[3, 1], [1, 2, 3], [1, 2, 3], [9]])))).toEqual([0, 3, 5, 6]);
    const err = caught(() =>
      maskCuSeqlens(
        packed([
          [1, 2],
          [1, 3],
        ]),
      ),
    ) as TreepackError;
    expect(err).toBeInstanceOf(TreepackError);
    expect(err.code).toBe('E_INPUT');
    expect(err.message).toMatch(/node 0 has more than one child/);
  });
});

describe('mask lowerings: bad input', () => {
  const good = randomTree(9, 50);
  const cases: [string, unknown, string, RegExp][] = [
    ['parent of the wrong type', { parent: Array.from(good.parent), subtree_end: good.subtree_end }, 'E_ARG', /Int32Array for parent/],
    ['subtree_end of the wrong type', { parent: good.parent, subtree_end: new Uint32Array(50) }, 'E_ARG', /Int32Array for subtree_end/],
    ['lengths differ', { parent: good.parent, subtree_end: good.subtree_end.subarray(1) }, 'E_INPUT', /49 elements but parent has N = 50/],
    ['parent after child', { parent: Int32Array.from([-1, 2, 0]), subtree_end: Int32Array.from([3, 3, 3]) }, 'E_INPUT', /parent\[1\] = 2/],
    [
      'subtree_end inconsistent with parent',
      { parent: Int32Array.from([-1, 0, -1]), subtree_end: Int32Array.from([3, 2, 3]) },
      'E_INPUT',
      /subtree_end\[0\] = 3: expected 2/,
    ],
    ['not a preorder', { parent: Int32Array.from([-1, -1, 0]), subtree_end: Int32Array.from([3, 2, 3]) }, 'E_INPUT', /not contiguous/],
    ['not an object', null, 'E_ARG', /for tree/],
  ];
  for (const [name, tree, code, re] of cases) {
    it(name, () => {
      for (const f of [maskDense, maskBits, maskSlices, maskCuSeqlens, (t: TreeArrays) => maskBlocks(t, 64)]) {
        const err = caught(() => f(tree as TreeArrays)) as TreepackError;
        expect(err).toBeInstanceOf(TreepackError);
        expect(err.code).toBe(code);
        expect(err.message).toMatch(re);
      }
    });
  }

  it('block size and dense sizes over the limit', () => {
    expect((caught(() => maskBlocks(good, 0)) as TreepackError).code).toBe('E_ARG');
    expect((caught(() => maskBlocks(good, 1.5)) as TreepackError).code).toBe('E_ARG');
    const big = randomTree(1, 50000, { pop: 0.5 });
    const err = caught(() => maskDense(big)) as TreepackError;
    expect(err.code).toBe('E_LIMIT');
    expect(err.message).toMatch(/dense mask for N = 50000 needs 2500000000 bytes/);
  });

  it('--masks specs', () => {
    expect(parseMaskSpecs('block:128,slices')).toEqual([{ kind: 'blocks', blockSize: 128 }, { kind: 'slices' }]);
    expect(parseMaskSpecs('block, cu_seqlens')).toEqual([{ kind: 'blocks', blockSize: 128 }, { kind: 'cu_seqlens' }]);
    for (const bad of ['block:0', 'block:12x', 'dense', 'slices:3', 'block:64,block:128']) {
      expect((caught(() => parseMaskSpecs(bad)) as TreepackError).code, bad).toBe('E_ARG');
    }
  });
});
