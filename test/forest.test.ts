/**
 * docs/design.md §7 invariants 1–4 and 7 for the TypeScript reference packer, checked against brute-force oracles
 * that share no code with the packer.
 */
import { describe, expect, it } from 'vitest';
import { packForest, sortSequences } from '../src/pack/forest.js';
import type { Forest } from '../src/pack/contract.js';
import { agentBatch, csr, randomBatch, shuffled } from './helpers/sequences.js';

function distinctPrefixes(seqs: number[][]): number {
  const set = new Set<string>();
  for (const s of seqs) for (let t = 1; t <= s.length; t++) set.add(s.slice(0, t).join(','));
  return set.size;
}

/** Checks invariants 1–3 and the canonical preorder; returns nothing, fails the test on the first violation. */
function expectExactForest(seqs: number[][], f: Forest): void {
  const N = f.input_ids.length;
  expect(f.position_ids.length).toBe(N);
  expect(f.parent.length).toBe(N);
  expect(f.subtree_end.length).toBe(N);
  expect(N).toBe(distinctPrefixes(seqs)); // invariant 3
  expect(f.seq_offsets.length).toBe(seqs.length + 1);
  for (let i = 0; i < seqs.length; i++) {
    const off = f.seq_offsets[i];
    expect(f.seq_offsets[i + 1] - off).toBe(seqs[i].length);
    const got = Array.from(f.seq_positions.subarray(off, off + seqs[i].length), (p) => f.input_ids[p]);
    expect(got).toEqual(seqs[i]); // invariant 1
    for (let t = 0; t < seqs[i].length; t++) {
      const p = f.seq_positions[off + t];
      expect(f.position_ids[p]).toBe(t); // invariant 2
      expect(f.parent[p]).toBe(t === 0 ? -1 : f.seq_positions[off + t - 1]);
    }
  }
  // Canonical preorder: siblings appear in ascending token order.
  const lastChildToken = new Map<number, number>();
  for (let p = 0; p < N; p++) {
    const prev = lastChildToken.get(f.parent[p]);
    if (prev !== undefined) expect(f.input_ids[p]).toBeGreaterThan(prev);
    lastChildToken.set(f.parent[p], f.input_ids[p]);
  }
}

/** Invariant 4: `k <= q < subtree_end[k]` equals "k is q or an ancestor of q" by walking parents. */
function expectMaskMatchesAncestry(f: Forest): void {
  const N = f.input_ids.length;
  for (let q = 0; q < N; q++) {
    const anc = new Set<number>();
    for (let k = q; k >= 0; k = f.parent[k]) anc.add(k);
    for (let k = 0; k < N; k++) {
      const visible = k <= q && q < f.subtree_end[k];
      if (visible !== anc.has(k)) throw new Error(`mask mismatch at q=${q} k=${k}`);
    }
  }
}

const nodeArrays = (f: Forest) =>
  [f.input_ids, f.position_ids, f.parent, f.subtree_end].map((a) => Buffer.from(a.buffer, a.byteOffset, a.byteLength).toString('hex'));

describe('packForest (js reference)', () => {
  it('empty batch', () => {
    const f = packForest(csr([]));
    expect(f.input_ids.length).toBe(0);
    expect(Array.from(f.seq_offsets)).toEqual([0]);
  });

  it('one token, empty sequences, duplicates, prefixes', () => {
    for (const seqs of [
      [[7]],
      [[], [], [3]],
      [
        [1, 2, 3],
        [1, 2, 3],
        [1, 2, 3],
      ],
      [[1, 2], [1, 2, 3, 4], [1], [1, 2, 3]],
      [
        [5, 1],
        [4, 2],
        [5, 0],
      ],
    ]) {
      const f = packForest(csr(seqs));
      expectExactForest(seqs, f);
      expectMaskMatchesAncestry(f);
    }
  });

  it('a known small forest, computed by hand', () => {
    const f = packForest(csr([[1, 2, 3], [1, 2, 4], [5], [1, 2]]));
    // Trie: 1→2→{3,4}, 5. Preorder with ascending siblings: 1,2,3,4,5.
    expect(Array.from(f.input_ids)).toEqual([1, 2, 3, 4, 5]);
    expect(Array.from(f.position_ids)).toEqual([0, 1, 2, 2, 0]);
    expect(Array.from(f.parent)).toEqual([-1, 0, 1, 1, -1]);
    expect(Array.from(f.subtree_end)).toEqual([4, 4, 3, 4, 5]);
    expect(Array.from(f.seq_positions)).toEqual([0, 1, 2, 0, 1, 3, 4, 0, 1]);
  });

  it('random batches: invariants 1–4', () => {
    for (let seed = 1; seed <= 300; seed++) {
      const seqs = randomBatch(seed);
      const f = packForest(csr(seqs));
      expectExactForest(seqs, f);
      if (f.input_ids.length <= 200) expectMaskMatchesAncestry(f);
    }
  });

  it('sortSequences orders lexicographically with exact adjacent LCPs', () => {
    for (let seed = 1; seed <= 200; seed++) {
      const seqs = randomBatch(seed, { alphabet: 3 });
      const { order, lcp } = sortSequences(csr(seqs));
      const expected = seqs
        .map((_, i) => i)
        .sort((a, b) => {
          const x = seqs[a],
            y = seqs[b];
          for (let t = 0; t < Math.min(x.length, y.length); t++) if (x[t] !== y[t]) return x[t] - y[t];
          return x.length - y.length || a - b;
        });
      expect(Array.from(order)).toEqual(expected);
      for (let k = 1; k < order.length; k++) {
        const x = seqs[order[k - 1]],
          y = seqs[order[k]];
        let h = 0;
        while (h < x.length && h < y.length && x[h] === y[h]) h++;
        expect(lcp[k]).toBe(h);
      }
    }
  });

  it('sortSequences finds exact LCPs of long sequences that differ anywhere around its compare blocks', () => {
    // lcpFrom compares token by token for 64 tokens, then in blocks of 4096 that halve down to 64.
    const base = Array.from({ length: 20_000 }, (_, i) => (i * 7919) % 1000);
    const at = new Set<number>();
    for (let h = 0; h <= 300; h++) at.add(h);
    for (let p = 32; p <= 16_384; p *= 2)
      for (const h of [p - 33, p - 32, p - 31, p - 1, p, p + 1, p + 31, p + 32, p + 33, 3 * p - 1]) at.add(h);
    const seqs: number[][] = [base, base.slice(0, 19_999)];
    for (const h of at) {
      if (h >= base.length) continue;
      const s = base.slice(0, h + 1 + (h % 5) * 1000);
      s[h] += h % 2 ? 1 : -1; // first difference at h, one sequence above the base and the next below
      seqs.push(s, s.slice(0, h + 1));
    }
    const { order, lcp } = sortSequences(csr(seqs));
    for (let k = 1; k < order.length; k++) {
      const x = seqs[order[k - 1]],
        y = seqs[order[k]];
      let h = 0;
      while (h < x.length && h < y.length && x[h] === y[h]) h++;
      expect(lcp[k], `lcp[${k}]`).toBe(h);
      const ordered = h === x.length || (h < y.length && x[h] < y[h]);
      expect(ordered, `order at ${k}`).toBe(true);
    }
  });

  it('invariant 7: node arrays depend only on the multiset of sequences', () => {
    for (let seed = 1; seed <= 100; seed++) {
      const seqs = randomBatch(seed);
      const a = packForest(csr(seqs));
      const { items, perm } = shuffled(seqs, seed * 7919);
      const b = packForest(csr(items));
      expect(nodeArrays(b)).toEqual(nodeArrays(a));
      // Per-sequence arrays follow the input order: sequence k of the shuffled batch is sequence perm[k].
      for (let k = 0; k < items.length; k++) {
        const pa = a.seq_positions.subarray(a.seq_offsets[perm[k]], a.seq_offsets[perm[k] + 1]);
        const pb = b.seq_positions.subarray(b.seq_offsets[k], b.seq_offsets[k + 1]);
        expect(Array.from(pb)).toEqual(Array.from(pa));
      }
    }
  });

  it('very deep: one 200k-token sequence and its prefixes', () => {
    const long = Array.from({ length: 200_000 }, (_, i) => (i * 7919) % 1000);
    const seqs = [long, long.slice(0, 1000), long.slice(0, 150_000), long.slice(0, 1)];
    const f = packForest(csr(seqs));
    expect(f.input_ids.length).toBe(200_000);
    expect(f.subtree_end[0]).toBe(200_000);
    expect(f.subtree_end[199_999]).toBe(200_000);
    for (let t = 0; t < 200_000; t++) if (f.parent[t] !== t - 1 || f.position_ids[t] !== t) throw new Error(`chain broken at ${t}`);
    for (let i = 0; i < seqs.length; i++) {
      const pos = f.seq_positions.subarray(f.seq_offsets[i], f.seq_offsets[i + 1]);
      for (let t = 0; t < pos.length; t++) if (pos[t] !== t) throw new Error(`sequence ${i} token ${t} maps to ${pos[t]}`);
    }
  });

  it('very wide: 20k sequences diverging after a shared token', () => {
    const seqs = Array.from({ length: 20_000 }, (_, i) => [42, 20_000 - i, i % 3]);
    const f = packForest(csr(seqs));
    expect(f.input_ids.length).toBe(1 + 20_000 * 2);
    expect(f.subtree_end[0]).toBe(f.input_ids.length);
    expectExactForest(seqs.slice(0, 50), packForest(csr(seqs.slice(0, 50))));
    // Root's children appear in ascending token order: 1, 2, …, 20000.
    let expectTok = 1;
    for (let p = 1; p < f.input_ids.length; p++) if (f.parent[p] === 0) expect(f.input_ids[p]).toBe(expectTok++);
  });

  it('long agent-shaped batch (≥ 128k tokens per sequence): exact and order-independent', () => {
    const s = agentBatch(3, { groups: 2, episodes: 3, turns: 8, prompt: 4000, step: 16_000 });
    const f = packForest(s);
    const S = s.offsets.length - 1;
    expect(s.offsets[S] - s.offsets[S - 1]).toBeGreaterThanOrEqual(128_000);
    // Each group shares its prompt; each episode adds 8 steps of 16k fresh tokens.
    expect(f.input_ids.length).toBe(2 * (4000 + 3 * 8 * 16_000));
    for (let i = 0; i + 1 < s.offsets.length; i++) {
      for (let t = s.offsets[i]; t < s.offsets[i + 1]; t++) {
        if (f.input_ids[f.seq_positions[t]] !== s.tokens[t]) throw new Error(`sequence ${i} token ${t - s.offsets[i]} differs`);
      }
    }
  });
});
