/**
 * The proof that packed training is exact (docs/design.md §7 invariant 5): a tiny float64 transformer (RoPE from
 * position_ids, 2 layers, 2 heads, random weights) gives every sequence's per-token logprobs unpacked (causal,
 * one sequence at a time) and on the packed forest (tree mask, node rule lp[p] = log_softmax(logits[parent[p]])
 * [input_ids[p]], gathered through seq_positions); they agree to 1e-9, and so does the gradient of a weighted
 * logprob loss with respect to every weight (reverse-mode autodiff on both sides). The packed side runs once with
 * the dense lowering and once with the block-sparse lowering applied as FlexAttention applies it (full block:
 * visible; partial: the mask_mod `k <= q < subtree_end[k]`; unlisted: masked), and once with the range slices.
 */
import { describe, expect, it } from 'vitest';
import { maskBlocks } from '../src/mask/blocks.js';
import { maskDense } from '../src/mask/dense.js';
import { maskSlices } from '../src/mask/slices.js';
import type { BlockMask } from '../src/mask/types.js';
import type { Forest, Sequences } from '../src/pack/contract.js';
import { packForest } from '../src/pack/forest.js';
import { sliceCoverage } from './helpers/masks.js';
import { csr, randomBatch, rng } from './helpers/sequences.js';
import { forward, logprob, tapeWithWeights, Weights } from './helpers/tiny-transformer.js';

const VOCAB = 11;

/** Loss = Σ over occurrences (i, t ≥ 1) of weight[i, t] · lp[i, t]; returns the logprobs and d loss / d weights. */
type Run = { lp: Float64Array; grad: Float64Array };

function unpacked(w: Weights, seqs: Sequences, weight: Float64Array): Run {
  const { tape, params } = tapeWithWeights(w);
  const M = seqs.tokens.length;
  const lp = new Float64Array(M);
  const terms: number[] = [];
  for (let i = 0; i + 1 < seqs.offsets.length; i++) {
    const off = seqs.offsets[i],
      L = seqs.offsets[i + 1] - off;
    if (L === 0) continue;
    const tokens = seqs.tokens.subarray(off, off + L);
    const logits = forward(
      tape,
      w,
      params,
      tokens,
      Int32Array.from({ length: L }, (_, t) => t),
      (q, k) => k <= q,
    );
    for (let t = 1; t < L; t++) {
      const node = logprob(tape, logits[t - 1], tokens[t]);
      lp[off + t] = tape.value(node);
      terms.push(tape.affine(node, weight[off + t]));
    }
  }
  return { lp, grad: gradient(tape, terms, params.length) };
}

function packedRun(w: Weights, f: Forest, weight: Float64Array, visible: (q: number, k: number) => boolean): Run {
  const { tape, params } = tapeWithWeights(w);
  const N = f.input_ids.length;
  const logits = forward(tape, w, params, f.input_ids, f.position_ids, visible);
  // The node rule: one logprob per non-root node, from its parent's logits.
  const node = new Int32Array(N).fill(-1);
  for (let p = 0; p < N; p++) if (f.parent[p] >= 0) node[p] = logprob(tape, logits[f.parent[p]], f.input_ids[p]);
  const M = f.seq_positions.length;
  const lp = new Float64Array(M);
  const terms: number[] = [];
  for (let i = 0; i + 1 < f.seq_offsets.length; i++) {
    for (let k = f.seq_offsets[i] + 1; k < f.seq_offsets[i + 1]; k++) {
      const n = node[f.seq_positions[k]];
      lp[k] = tape.value(n);
      terms.push(tape.affine(n, weight[k]));
    }
  }
  return { lp, grad: gradient(tape, terms, params.length) };
}

function gradient(tape: ReturnType<typeof tapeWithWeights>['tape'], terms: number[], P: number): Float64Array {
  if (terms.length === 0) return new Float64Array(P);
  return tape.backward(tape.sum(terms)).slice(0, P);
}

/** FlexAttention's reading of a BlockMask: full blocks visible, partial ones through the mask_mod, others masked. */
function flexVisible(m: BlockMask, subtree_end: Int32Array): (q: number, k: number) => boolean {
  const nb = m.num_blocks,
    B = m.block_size;
  const kind = new Int8Array(nb * nb);
  for (let i = 0; i < nb; i++) {
    for (let t = 0; t < m.block_kv_num_blocks[i]; t++) kind[i * nb + m.block_kv_indices[i * nb + t]] = 1;
    for (let t = 0; t < m.block_full_kv_num_blocks[i]; t++) kind[i * nb + m.block_full_kv_indices[i * nb + t]] = 2;
  }
  return (q, k) => {
    const c = kind[Math.floor(q / B) * nb + Math.floor(k / B)];
    return c === 2 || (c === 1 && k <= q && q < subtree_end[k]);
  };
}

function maxAbsDiff(a: Float64Array, b: Float64Array): number {
  let d = 0;
  for (let i = 0; i < a.length; i++) d = Math.max(d, Math.abs(a[i] - b[i]) / Math.max(1, Math.abs(b[i])));
  return d;
}

const cases: [string, number[][]][] = [
  ['empty batch', []],
  ['single tokens and an empty sequence', [[3], [], [3], [5]]],
  [
    'duplicates',
    [
      [1, 2, 3, 4],
      [1, 2, 3, 4],
      [1, 2, 3, 4],
    ],
  ],
  [
    'a sequence that is a prefix of another',
    [
      [1, 2, 3],
      [1, 2, 3, 4, 5, 6],
      [1, 2],
    ],
  ],
  ['wide fan-out', Array.from({ length: 10 }, (_, i) => [7, 8, 9, i % VOCAB, (3 * i) % VOCAB])],
  [
    'deep chain with branches',
    [Array.from({ length: 40 }, (_, i) => (i * 7) % VOCAB), Array.from({ length: 25 }, (_, i) => (i * 7) % VOCAB).concat([0, 1])],
  ],
];
for (let seed = 1; seed <= 6; seed++) cases.push([`random forest ${seed}`, randomBatch(seed, { count: 8, maxLen: 14, alphabet: 3 })]);

describe('packed training is exact: tiny transformer, unpacked vs packed forest', () => {
  for (const [name, seqsArr] of cases) {
    it(name, { timeout: 60_000 }, () => {
      const seqs = csr(seqsArr);
      const forest = packForest(seqs);
      const N = forest.input_ids.length;
      const w = new Weights(VOCAB, 1234 + seqsArr.length);
      const r = rng(99);
      const weight = Float64Array.from({ length: seqs.tokens.length }, () => (r() < 0.2 ? 0 : r() * 2 - 1));

      const ref = unpacked(w, seqs, weight);
      const dense = maskDense(forest);
      const slices = sliceCoverage(maskSlices(forest), N);
      const masks: [string, (q: number, k: number) => boolean][] = [
        ['dense', (q, k) => dense[q * N + k] === 1],
        ['block-sparse B=4', flexVisible(maskBlocks(forest, 4), forest.subtree_end)],
        ['slices', (q, k) => slices[q * N + k] === 1],
      ];
      for (const [label, visible] of masks) {
        const got = packedRun(w, forest, weight, visible);
        expect(maxAbsDiff(got.lp, ref.lp), `${label}: logprobs`).toBeLessThan(1e-9);
        expect(maxAbsDiff(got.grad, ref.grad), `${label}: gradients`).toBeLessThan(1e-9);
      }
      // The proof has teeth: the loss has a gradient, and a plain causal mask over the packed stream breaks it.
      if (seqsArr.some((s) => s.length > 1) && weight.some((x, k) => x !== 0 && k > 0)) {
        expect(ref.grad.some((g) => Math.abs(g) > 1e-6)).toBe(true);
      }
      if (forest.parent.some((p, i) => p >= 0 && p !== i - 1)) {
        const wrong = packedRun(w, forest, weight, (q, k) => k <= q);
        expect(maxAbsDiff(wrong.lp, ref.lp)).toBeGreaterThan(1e-6);
      }
    });
  }
});
