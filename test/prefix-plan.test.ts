/**
 * Step plans with prefix reuse (src/pack/prefix.ts): each rank's stack operations replayed on the micro-batches'
 * own forests (the pushed segments are the chain nodes of the micro-batch that pushes them, the stack matches every
 * micro-batch's cached chain, everything is released), every sequence in exactly one micro-batch, the budgets, the
 * cache refusal, determinism and order independence. Expected values come from the sequences and forests directly.
 */
import { mkdtempSync } from 'node:fs';
import { readMicroBatch, writeMicroBatch } from '../src/io/microbatch.js';
import type { MicroBatch } from '../src/pack/contract.js';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { TreepackError } from '../src/errors.js';
import { dpFloorTokens, planMicroBatches, type Plan } from '../src/pack/budget.js';
import { packForest } from '../src/pack/forest.js';
import { caught } from './helpers/errors.js';
import { agentBatch, csr, randomBatch, rng, shuffled, toArrays } from './helpers/sequences.js';

interface Replay {
  /** tokens run with grad: micro-batches' own nodes and popped segments */
  computed: number;
  pushed: number;
  peak: number;
}

/** Replays each rank's plan on the forests; throws on any inconsistency. */
function replay(seqs: number[][], plan: Plan, K: number, B: number, C: number): Replay {
  const out: Replay = { computed: 0, pushed: 0, peak: 0 };
  for (let r = 0; r < K; r++) {
    const stack: { start: number; tokens: number[] }[] = [];
    const mbs = plan.microBatches.filter((m) => m.rank === r).sort((a, b) => a.step - b.step);
    mbs.forEach((m, step) => expect(m.step).toBe(step));
    for (const m of mbs) {
      const f = packForest(csr(Array.from(m.sequences, (i) => seqs[i])));
      const N = f.input_ids.length;
      expect(N).toBe(m.packedTokens);
      const op = m.prefix!;
      const h = op.tokens;
      for (let p = 0; p < h; p++) {
        expect(f.parent[p]).toBe(p - 1);
        expect(f.position_ids[p]).toBe(p);
      }
      let depth = stack.length ? stack[stack.length - 1].start + stack[stack.length - 1].tokens.length : 0;
      const held = stack.flatMap((s) => s.tokens);
      expect(held.slice(0, Math.min(depth, h))).toEqual(Array.from(f.input_ids.subarray(0, Math.min(depth, h))));
      for (const e of op.push) {
        expect(e).toBeGreaterThan(depth);
        expect(e - depth).toBeLessThanOrEqual(B);
        stack.push({ start: depth, tokens: Array.from(f.input_ids.subarray(depth, e)) });
        out.pushed += e - depth;
        out.computed += e - depth;
        depth = e;
      }
      expect(depth).toBe(h);
      expect(h).toBeLessThanOrEqual(C);
      out.peak = Math.max(out.peak, h);
      expect(N - h).toBeLessThanOrEqual(B);
      // Computed nodes hang from the chain's last node only: one state at depth h is all a recurrent layer would need.
      for (let p = h; p < N; p++) if (f.parent[p] >= 0 && f.parent[p] < h) expect(f.parent[p]).toBe(h - 1);
      expect(m.computedTokens).toBe(N - h);
      out.computed += N - h;
      expect(op.release).toBeLessThanOrEqual(stack.length);
      stack.splice(stack.length - op.release, op.release);
    }
    expect(stack).toEqual([]);
  }
  return out;
}

function exactlyOnce(plan: Plan, S: number): void {
  const seen = new Int32Array(S);
  for (const m of plan.microBatches) for (const i of m.sequences) seen[i]++;
  expect(Array.from(seen)).toEqual(new Array(S).fill(1));
}

/** The plan as content: per (rank, step) the sorted token sequences and the stack operations. */
const content = (seqs: number[][], plan: Plan) =>
  plan.microBatches.map((m) => ({
    rank: m.rank,
    step: m.step,
    seqs: Array.from(m.sequences, (i) => seqs[i].join(',')).sort(),
    prefix: m.prefix,
  }));

describe('prefix-reuse step plans', () => {
  it('replays on the forests, trains every sequence once, holds the budgets, and computes the single forest once per rank', () => {
    for (let seed = 0; seed < 30; seed++) {
      const seqs = randomBatch(seed, { maxLen: 30 });
      const optimum = packForest(csr(seqs)).input_ids.length;
      for (const B of [4, 9, 25, 1000]) {
        for (const K of [1, 3]) {
          const plan = planMicroBatches(csr(seqs), { maxTokens: B, dp: K, prefixCacheTokens: 1 << 20, sharedPrefix: false });
          exactlyOnce(plan, seqs.length);
          expect(plan.microBatches.length % K).toBe(0);
          const got = replay(seqs, plan, K, B, 1 << 20);
          expect(plan.prefixReuse).toMatchObject({ computedTokens: got.computed, pushedTokens: got.pushed, peakCachedTokens: got.peak });
          if (K === 1) expect(got.computed).toBe(optimum);
          else expect(got.computed).toBeGreaterThanOrEqual(optimum);
        }
      }
    }
  });

  it('stays near the optimum on agent chains where the plain split repeats the prompts', () => {
    const seqs = toArrays(agentBatch(5, { groups: 3, episodes: 6, turns: 8, prompt: 300, step: 60 }));
    const optimum = packForest(csr(seqs)).input_ids.length;
    const B = Math.ceil(optimum / 8);
    for (const K of [1, 2, 4]) {
      const plan = planMicroBatches(csr(seqs), {
        maxTokens: B,
        dp: K,
        prefixCacheTokens: 1 << 20,
        prefixBytesPerToken: 10,
        sharedPrefix: false,
      });
      const got = replay(seqs, plan, K, B, 1 << 20);
      // Each boundary between ranks repeats at most one root path: the chain the next rank's first micro-batch hangs from.
      const longest = Math.max(...seqs.map((s) => s.length));
      if (K === 1) expect(got.computed).toBe(optimum);
      else expect(got.computed - optimum).toBeLessThanOrEqual((K - 1) * longest);
      expect(plan.prefixReuse!.peakCachedBytes).toBe(10 * got.peak);
      const plain = planMicroBatches(csr(seqs), { maxTokens: Math.max(B, ...seqs.map((s) => s.length)), dp: K });
      const plainTokens = plain.microBatches.reduce((a, m) => a + m.packedTokens, 0);
      expect(got.computed).toBeLessThan(plainTokens);
    }
  });

  it('hangs a sequence longer than the budget from its own cached prefix', () => {
    const r = rng(1);
    const long = Array.from({ length: 50 }, () => Math.floor(r() * 7));
    const seqs = [long, long.slice(0, 20).concat([1, 2, 3])];
    const plan = planMicroBatches(csr(seqs), { maxTokens: 16, prefixCacheTokens: 100 });
    const got = replay(seqs, plan, 1, 16, 100);
    expect(got.computed).toBe(packForest(csr(seqs)).input_ids.length);
  });

  it('is deterministic and depends on the multiset of sequences only', () => {
    for (let seed = 0; seed < 20; seed++) {
      const seqs = randomBatch(100 + seed, { maxLen: 20 });
      const moved = shuffled(seqs, seed).items;
      for (const K of [1, 2]) {
        const opts = { maxTokens: 12, dp: K, prefixCacheTokens: 1000 };
        const a = planMicroBatches(csr(seqs), opts);
        expect(content(seqs, planMicroBatches(csr(seqs), opts))).toEqual(content(seqs, a));
        expect(content(moved, planMicroBatches(csr(moved), opts))).toEqual(content(seqs, a));
      }
    }
  });

  it('refuses a plan that needs more cache than allowed, naming the need', () => {
    const seqs = toArrays(agentBatch(2, { groups: 1, episodes: 4, turns: 4, prompt: 200, step: 40 }));
    const e = caught(() =>
      planMicroBatches(
        csr(seqs),
        { maxTokens: 120, prefixCacheTokens: 50 },
        seqs.map((_, i) => `s${i}`),
      ),
    ) as TreepackError;
    expect(e).toBeInstanceOf(TreepackError);
    expect(e.code).toBe('E_ARG');
    expect(e.message).toMatch(/needs \d+ cached prefix tokens on rank 0 .*allows 50/);
    expect((caught(() => planMicroBatches(csr(seqs), { maxTokens: 4, padMultiple: 8, prefixCacheTokens: 500 })) as Error).message).toMatch(
      /pad multiple 8 is larger than the token budget 4/,
    );
  });

  it("pads each micro-batch's computed nodes to a multiple of P within T: the plan of floor(T / P)·P, plus padding", () => {
    for (const seed of [1, 2, 3]) {
      const seqs = randomBatch(300 + seed, { maxLen: 30 });
      for (const K of [1, 2]) {
        for (const [T, P] of [
          [20, 8],
          [33, 4],
        ]) {
          const padded = planMicroBatches(csr(seqs), { maxTokens: T, padMultiple: P, dp: K, prefixCacheTokens: 1000 });
          const plain = planMicroBatches(csr(seqs), { maxTokens: Math.floor(T / P) * P, dp: K, prefixCacheTokens: 1000 });
          expect(content(seqs, padded)).toEqual(content(seqs, plain));
          let pads = 0;
          padded.microBatches.forEach((m, b) => {
            const q = plain.microBatches[b];
            const own = q.packedTokens - q.prefix!.tokens; // the nodes past the cached prefix, unpadded
            expect(m.padTokens).toBe((P - (own % P)) % P);
            expect(m.packedTokens).toBe(q.packedTokens + m.padTokens);
            expect(m.computedTokens).toBe(own + m.padTokens);
            expect(m.computedTokens! % P).toBe(0);
            expect(m.computedTokens!).toBeLessThanOrEqual(T);
            pads += m.padTokens;
          });
          expect(pads).toBeGreaterThan(0);
          expect(padded.prefixReuse!.computedTokens).toBe(plain.prefixReuse!.computedTokens + pads);
          expect(padded.prefixReuse!.pushedTokens).toBe(plain.prefixReuse!.pushedTokens);
        }
      }
    }
  });

  it('writes and reads the step-plan header keys, all three or none, checked', () => {
    const dir = mkdtempSync(join(tmpdir(), 'treepack-prefix-io-'));
    const seqs = [
      [1, 2, 3, 4],
      [1, 2, 3, 5, 6],
    ];
    const f = packForest(csr(seqs));
    const base: MicroBatch = {
      ...f,
      loss_mask: new Uint8Array(9),
      meta: {
        format: 'treepack/1',
        num_sequences: 2,
        num_tokens_naive: 9,
        num_tokens_packed: f.input_ids.length,
        tokenizer: 't',
        sequence_ids: ['a', 'b'],
      },
    };
    const path = join(dir, 'mb.safetensors');
    writeMicroBatch(path, { ...base, meta: { ...base.meta, prefix_tokens: 3, prefix_push: [1, 3], prefix_release: 2 } });
    expect(readMicroBatch(path).batch.meta).toMatchObject({ prefix_tokens: 3, prefix_push: [1, 3], prefix_release: 2 });
    writeMicroBatch(path, base);
    expect(readMicroBatch(path).batch.meta.prefix_tokens).toBeUndefined();
    const bad = (meta: Partial<MicroBatch['meta']>) =>
      (caught(() => writeMicroBatch(path, { ...base, meta: { ...base.meta, ...meta } })) as TreepackError).message;
    expect(bad({ prefix_tokens: 3 })).toMatch(/go together/);
    expect(bad({ prefix_tokens: 3, prefix_push: [3, 2], prefix_release: 0 })).toMatch(/ascending depths ending at prefix_tokens = 3/);
    expect(bad({ prefix_tokens: 30, prefix_push: [], prefix_release: 0 })).toMatch(
      /prefix_tokens = 30, expected an integer in \[0, N = 6\]/,
    );
  });

  it('walks a chain thousands of levels deep (each request extends the previous one)', () => {
    const S = 5000;
    const seqs = csr(Array.from({ length: S }, (_, k) => Array.from({ length: k + 1 }, (_, t) => (t * 7) % 13)));
    const plan = planMicroBatches(seqs, { maxTokens: 100, prefixCacheTokens: S });
    expect(plan.prefixReuse).toMatchObject({ computedTokens: S, pushedTokens: S - 100, peakCachedTokens: S - 100 });
    exactlyOnce(plan, S);
  });

  it('never computes fewer tokens than the data-parallel floor with each rank to itself, and reaches it where the ranks split a shared prompt', () => {
    // 8 sequences: a 10-token prompt, then 5 tokens of their own. Optimum 10 + 8·5 = 50; every one of 4 ranks that
    // gets a sequence computes the prompt: floor 50 + 3·10 = 80, which two sequences per rank reach.
    const prompt = Array.from({ length: 10 }, (_, k) => 1000 + k);
    const seqs = Array.from({ length: 8 }, (_, i) => [...prompt, ...Array.from({ length: 5 }, (_, k) => 100 * i + k)]);
    const plan = planMicroBatches(csr(seqs), { maxTokens: 1000, dp: 4, prefixCacheTokens: 1 << 20, sharedPrefix: false });
    expect(plan.optimumTokens).toBe(50);
    expect(new Set(plan.microBatches.filter((m) => m.sequences.length).map((m) => m.rank)).size).toBe(4);
    expect(dpFloorTokens(csr(seqs), plan)).toBe(80);
    expect(plan.prefixReuse!.computedTokens).toBe(80);
    // Shared prefixes (docs/design.md §11) go below it: the prompt is computed once, in shares of the four ranks.
    expect(planMicroBatches(csr(seqs), { maxTokens: 1000, dp: 4, prefixCacheTokens: 1 << 20 }).prefixReuse!.computedTokens).toBe(50);
    // one rank: the floor is the optimum
    expect(dpFloorTokens(csr(seqs), planMicroBatches(csr(seqs), { maxTokens: 1000, prefixCacheTokens: 1 << 20 }))).toBe(50);
    // random batches behind a shared prompt: a floor, never crossed, at every budget and rank count
    for (let seed = 0; seed < 20; seed++) {
      const batch = randomBatch(seed, { maxLen: 30 }).map((x) => [...prompt, ...x]);
      for (const B of [20, 45, 1000]) {
        for (const K of [2, 3, 5]) {
          const p = planMicroBatches(csr(batch), { maxTokens: B, dp: K, prefixCacheTokens: 1 << 20, sharedPrefix: false });
          const floor = dpFloorTokens(csr(batch), p);
          expect(floor).toBeGreaterThanOrEqual(
            p.optimumTokens +
              (batch.length > 1 ? 10 : 0) * (new Set(p.microBatches.filter((m) => m.sequences.length).map((m) => m.rank)).size - 1),
          );
          expect(p.prefixReuse!.computedTokens).toBeGreaterThanOrEqual(floor);
        }
      }
    }
  });

  it('plans an empty window as no micro-batches', () => {
    expect(planMicroBatches(csr([]), { maxTokens: 8, dp: 4, prefixCacheTokens: 8 }).microBatches).toEqual([]);
  });

  it('leaves plans without prefix reuse as they were', () => {
    const seqs = randomBatch(7, { maxLen: 20 });
    const plan = planMicroBatches(csr(seqs), { maxTokens: 30, dp: 2 });
    expect(plan.prefixReuse).toBeUndefined();
    expect(plan.microBatches.every((m) => m.prefix === undefined && m.computedTokens === undefined)).toBe(true);
  });
});
