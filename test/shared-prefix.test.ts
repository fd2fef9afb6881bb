/**
 * Shared prefixes and the parallel planner (docs/design.md §11; src/pack/share.ts, src/pack/planner.ts).
 *
 * The invariant checker replays every rank's stack on the micro-batches' own sequences, taking a segment the plan
 * marks shared from its piece (which must be the same tokens, at the same depths, with the rank in the piece's group),
 * and counts every node (a distinct root path) each time some rank computes it: a micro-batch's own nodes, a segment
 * a rank pushes alone (computed once with grad when popped), a rank's range of a shared piece. With shared prefixes
 * every node of the forest is computed exactly once per data-parallel group; the manifest figures equal the counts.
 */
import { describe, expect, it } from 'vitest';
import { TreepackError } from '../src/errors.js';
import { planMicroBatches, type BudgetOptions, type Plan } from '../src/pack/budget.js';
import { caught } from './helpers/errors.js';
import { agentBatch, csr, randomBatch, rng, shuffled, toArrays } from './helpers/sequences.js';

interface Counted {
  /** node (its id in the trie of all sequences) → times computed with grad */
  nodes: Map<number, number>;
  computed: number;
  pushed: number;
  peak: number;
}

/** Per sequence, the id of its node at each depth in the trie of all sequences (a node is a distinct root path). */
function trieIds(seqs: number[][]): Int32Array[] {
  const child = new Map<string, number>();
  return seqs.map((s) => {
    const ids = new Int32Array(s.length);
    let at = -1;
    s.forEach((t, d) => {
      const k = `${at}:${t}`;
      if (!child.has(k)) child.set(k, child.size);
      ids[d] = at = child.get(k)!;
    });
    return ids;
  });
}

const must = (ok: boolean, what: string): void => {
  if (!ok) throw new Error(`invariant broken: ${what}`);
};

/** Replays the plan (brute force, from the sequences); throws on any inconsistency. */
function check(seqs: number[][], plan: Plan, K: number, B: number, C: number): Counted {
  const nodes = new Map<number, number>();
  const add = (k: number) => nodes.set(k, (nodes.get(k) ?? 0) + 1);
  const ids = trieIds(seqs);
  const pieces = plan.sharedPrefixes ?? [];
  let computed = 0,
    pushed = 0,
    peak = 0;
  const pinned = new Array<number>(K).fill(0);
  for (const p of pieces) {
    const path = seqs[p.sequence];
    must(path.length >= p.end, 'a piece lies on its sequence');
    must(p.end > p.start, 'a piece is not empty');
    must(p.end - p.start <= B, 'a piece fits the budget');
    must(p.ranks.length >= 2, 'a piece has a group');
    p.ranks.forEach((r, i) => {
      must((i === 0 || r === p.ranks[i - 1] + 1) && r < K, 'a group is contiguous ranks');
    });
    must(p.ranges.length === p.ranks.length, 'a range per rank');
    let at = p.start;
    p.ranges.forEach(([a, b], i) => {
      must(a === at && b >= a, 'ranges are contiguous');
      for (let d = a; d < b; d++) add(ids[p.sequence][d]);
      pinned[p.ranks[i]] += p.end - p.start;
      at = b;
    });
    must(at === p.end, 'ranges cover the piece');
    computed += p.end - p.start;
    pushed += p.end - p.start;
  }
  for (let r = 0; r < K; r++) {
    const stack: { start: number; end: number; piece: number | null }[] = [];
    const mbs = plan.microBatches.filter((m) => m.rank === r).sort((a, b) => a.step - b.step);
    for (const m of mbs) {
      const members = Array.from(m.sequences, (i) => seqs[i]);
      const op = m.prefix!;
      const h = op.tokens;
      // The chain: the root path of a member at least h long; every member runs along it.
      const at = Array.from(m.sequences).find((i) => seqs[i].length >= h) ?? -1;
      must(h === 0 || at >= 0, 'a member holds the chain');
      const chain = at >= 0 ? seqs[at] : [];
      for (const s of members) for (let d = 0; d < Math.min(s.length, h); d++) must(s[d] === chain[d], 'members run along the chain');
      let depth = stack.length ? stack[stack.length - 1].end : 0;
      must(!op.shared || op.shared.length === op.push.length, 'prefix_shared matches prefix_push');
      op.push.forEach((e, k) => {
        must(e > depth && e - depth <= B, 'pushes ascend within the budget');
        const id = op.shared?.[k] ?? null;
        if (id !== null) {
          const p = pieces[id];
          // The rank has the prefix it needs: the piece is this chain's segment, and the rank is in its group.
          must(p.start === depth && p.end === e && p.ranks.includes(r), `rank ${r} takes piece ${id} as its segment [${depth}, ${e})`);
          for (let d = 0; d < e; d++) must(ids[p.sequence][d] === ids[at][d], 'the piece is the chain');
        } else {
          for (let d = depth; d < e; d++) add(ids[at][d]);
          computed += e - depth;
          pushed += e - depth;
        }
        stack.push({ start: depth, end: e, piece: id });
        depth = e;
      });
      must(depth === h, 'the stack reaches the chain');
      // The stack holds the chain exactly: contiguous segments from depth 0.
      stack.forEach((s, k) => must(s.start === (k ? stack[k - 1].end : 0), 'the stack is contiguous'));
      const own = stack.filter((s) => s.piece === null).reduce((a, s) => a + s.end - s.start, 0);
      peak = Math.max(peak, own + pinned[r]);
      must(own + pinned[r] <= C, 'the cache holds');
      const mine = new Set<number>();
      for (const i of m.sequences) for (let d = h; d < seqs[i].length; d++) mine.add(ids[i][d]);
      for (const k of mine) add(k);
      must(m.computedTokens === mine.size, 'computedTokens is its own nodes');
      computed += mine.size;
      must(mine.size <= B, 'a micro-batch fits the budget');
      must(op.release <= stack.length, 'releases what it holds');
      stack.splice(stack.length - op.release, op.release);
    }
    must(stack.length === 0, 'everything is released');
  }
  return { nodes, computed, pushed, peak };
}

/** Every distinct root path of the sequences: the single forest's nodes. */
function forestNodes(seqs: number[][]): Set<number> {
  return new Set(trieIds(seqs).flatMap((x) => Array.from(x)));
}

const BIG = 1 << 20;

/** Plans with shared prefixes and checks: the counts match the plan's figures, and every node is computed once. */
function planAndCheck(seqs: number[][], opts: BudgetOptions): { plan: Plan; got: Counted } {
  const plan = planMicroBatches(csr(seqs), opts);
  const K = opts.dp ?? 1;
  const got = check(seqs, plan, K, opts.maxTokens, opts.prefixCacheTokens!);
  expect(plan.prefixReuse).toMatchObject({ computedTokens: got.computed, pushedTokens: got.pushed, peakCachedTokens: got.peak });
  const seen = new Int32Array(seqs.length);
  for (const m of plan.microBatches) for (const i of m.sequences) seen[i]++;
  expect(Array.from(seen)).toEqual(new Array(seqs.length).fill(1));
  return { plan, got };
}

function onceEach(seqs: number[][], got: Counted): void {
  const all = forestNodes(seqs);
  expect(got.nodes.size).toBe(all.size);
  for (const [k, n] of got.nodes) must(all.has(k) && n === 1, `node ${k} computed ${n} times`);
  expect(got.computed).toBe(all.size);
}

describe('shared prefixes', () => {
  it('computes every node of random forests exactly once per data-parallel group, each rank holding what it hangs from', () => {
    for (let seed = 0; seed < 15; seed++) {
      const seqs = randomBatch(seed, { maxLen: 30 });
      for (const B of [4, 9, 25, 1000]) {
        for (const K of [1, 2, 3, 8]) {
          const { plan, got } = planAndCheck(seqs, { maxTokens: B, dp: K, prefixCacheTokens: BIG });
          onceEach(seqs, got);
          if (K === 1) expect(plan.sharedPrefixes).toBeUndefined();
        }
      }
    }
  });

  it('matches brute-force counts with sharing off too (each rank its own prefixes)', () => {
    for (let seed = 0; seed < 10; seed++) {
      const seqs = randomBatch(50 + seed, { maxLen: 25 });
      for (const K of [2, 5]) {
        const { plan, got } = planAndCheck(seqs, { maxTokens: 10, dp: K, prefixCacheTokens: BIG, sharedPrefix: false });
        expect(plan.sharedPrefixes).toBeUndefined();
        expect(plan.microBatches.every((m) => m.prefix!.shared === undefined)).toBe(true);
        expect(got.computed).toBeGreaterThanOrEqual(forestNodes(seqs).size);
      }
    }
  });

  it('handles adversarial forests: more ranks than branches, a prompt on every rank, deep chains, a tree past the budget', () => {
    const r = rng(3);
    const tok = () => Math.floor(r() * 5);
    const prompt = Array.from({ length: 40 }, (_, k) => 1000 + k);
    const cases: [string, number[][], number, number][] = [
      ['more ranks than branches', [prompt.concat([1, 2]), prompt.concat([3]), prompt.concat([4, 5, 6])], 12, 8],
      ['a prompt shared by all ranks', Array.from({ length: 16 }, (_, i) => prompt.concat([i, tok(), tok()])), 10, 4],
      ['a deep chain', Array.from({ length: 60 }, (_, k) => Array.from({ length: 3 * (k + 1) }, (_, t) => (t * 7) % 11)), 16, 4],
      [
        'a tree larger than the budget',
        [Array.from({ length: 200 }, tok), ...Array.from({ length: 6 }, () => prompt.concat([tok()]))],
        16,
        3,
      ],
      ['one rank', Array.from({ length: 5 }, (_, i) => prompt.concat([i])), 8, 1],
      ['single tokens and duplicates', [[1], [1], [2], [1, 2], [1, 2]], 1, 4],
    ];
    for (const [name, seqs, B, K] of cases) {
      const { plan, got } = planAndCheck(seqs, { maxTokens: B, dp: K, prefixCacheTokens: BIG });
      onceEach(seqs, got);
      expect(plan.prefixReuse!.computedTokens, name).toBe(plan.optimumTokens);
    }
    // The prompt on every rank is computed in pieces over all 4 ranks, each rank a near-equal contiguous range.
    const all = planMicroBatches(csr(cases[1][1]), { maxTokens: 10, dp: 4, prefixCacheTokens: BIG }).sharedPrefixes!;
    const onPrompt = all.filter((p) => p.end <= prompt.length).sort((x, y) => x.start - y.start);
    expect(onPrompt.map((p) => [p.start, p.end]).flat()).toEqual(onPrompt.flatMap((p, k) => [k ? onPrompt[k - 1].end : 0, p.end]));
    expect(onPrompt[onPrompt.length - 1].end).toBe(prompt.length);
    for (const p of onPrompt) {
      expect(p.ranks).toEqual([0, 1, 2, 3]);
      const sizes = p.ranges.map(([a, b]) => b - a);
      expect(Math.max(...sizes) - Math.min(...sizes)).toBeLessThanOrEqual(1);
    }
  });

  it('brings agent chains behind a shared prompt to the single-forest optimum where each rank alone repeats it', () => {
    const seqs = toArrays(agentBatch(5, { groups: 3, episodes: 6, turns: 8, prompt: 300, step: 60 }));
    const optimum = forestNodes(seqs).size;
    for (const K of [2, 4, 8]) {
      const B = Math.ceil(optimum / 8);
      const alone = planMicroBatches(csr(seqs), { maxTokens: B, dp: K, prefixCacheTokens: BIG, sharedPrefix: false });
      const { plan, got } = planAndCheck(seqs, { maxTokens: B, dp: K, prefixCacheTokens: BIG });
      onceEach(seqs, got);
      expect(plan.prefixReuse!.computedTokens).toBe(optimum);
      expect(alone.prefixReuse!.computedTokens).toBeGreaterThan(optimum);
    }
  });

  it('has a checker that catches a node computed twice and a rank without the piece it hangs from', () => {
    const prompt = Array.from({ length: 12 }, (_, k) => 700 + k);
    const seqs = Array.from({ length: 6 }, (_, i) => prompt.concat([i, i + 1]));
    const opts = { maxTokens: 6, dp: 3, prefixCacheTokens: BIG };
    const fresh = () => planMicroBatches(csr(seqs), opts);
    const { got } = planAndCheck(seqs, opts);
    onceEach(seqs, got);
    // A segment taken from a piece, recomputed by its rank alone instead: its nodes are computed twice.
    const twice = fresh();
    const m = twice.microBatches.find((x) => x.prefix!.shared?.some((id) => id !== null))!;
    m.prefix!.shared = m.prefix!.shared!.map(() => null);
    expect(() => onceEach(seqs, check(seqs, twice, 3, 6, BIG))).toThrow(/computed 2 times/);
    // A piece whose group leaves out a rank that hangs from it.
    const missing = fresh();
    const piece = missing.sharedPrefixes![0];
    piece.ranks = piece.ranks.slice(0, -1);
    piece.ranges = piece.ranges.slice(0, -1);
    expect(() => check(seqs, missing, 3, 6, BIG)).toThrow(/invariant broken/);
  });

  it('is deterministic and depends on the multiset of sequences only', () => {
    for (let seed = 0; seed < 10; seed++) {
      const seqs = randomBatch(200 + seed, { maxLen: 20 });
      const moved = shuffled(seqs, seed).items;
      const opts = { maxTokens: 8, dp: 3, prefixCacheTokens: 1000 };
      const content = (xs: number[][], p: Plan) => ({
        pieces: (p.sharedPrefixes ?? []).map(({ sequence, ...rest }) => ({ path: xs[sequence].slice(0, rest.end), ...rest })),
        mbs: p.microBatches.map((m) => ({ rank: m.rank, step: m.step, seqs: Array.from(m.sequences, (i) => xs[i]).sort(), op: m.prefix })),
      });
      const a = content(seqs, planMicroBatches(csr(seqs), opts));
      expect(content(seqs, planMicroBatches(csr(seqs), opts))).toEqual(a);
      expect(content(moved, planMicroBatches(csr(moved), opts))).toEqual(a);
    }
  });

  it('counts the pinned pieces in the cache and refuses a plan whose shares do not fit, naming the record', () => {
    const prompt = Array.from({ length: 30 }, (_, k) => 500 + k);
    const seqs = Array.from({ length: 8 }, (_, i) => prompt.concat(Array.from({ length: 30 }, (_, k) => 10 * i + k)));
    const e = caught(() =>
      planMicroBatches(
        csr(seqs),
        { maxTokens: 16, dp: 4, prefixCacheTokens: 20 },
        seqs.map((_, i) => `s${i}`),
      ),
    ) as TreepackError;
    expect(e).toBeInstanceOf(TreepackError);
    expect(e.code).toBe('E_ARG');
    expect(e.message).toMatch(/record "s\d".*no parallel plan can train this step/);
    expect(e.message).toMatch(/cached prefix tokens/);
  });
});

describe('the parallel planner', () => {
  it('keeps plain data parallelism where no prefix spans ranks', () => {
    // Four unrelated sequences on two ranks: nothing to share.
    const seqs = [0, 1, 2, 3].map((i) => Array.from({ length: 10 }, (_, k) => 100 * i + k));
    const plan = planMicroBatches(csr(seqs), { maxTokens: 20, dp: 2, prefixCacheTokens: 100, cp: 2 });
    expect(plan.choice!.mode).toBe('dp');
    expect(plan.choice!.cp).toBe(1);
    expect(plan.sharedPrefixes).toBeUndefined();
    expect(plan.choice!.candidates.map((c) => [c.mode, c.cp])).toEqual([
      ['dp', 1],
      ['shared', 1],
      ['cp', 2],
    ]);
    // The cost of CP is its bytes: the same compute, plus the K/V it moves.
    const cp = plan.choice!.candidates[2];
    expect(cp.max_rank_bytes).toBeGreaterThan(0);
    expect(cp.time).toBeGreaterThan(plan.choice!.candidates[0].time!);
  });

  it('shares a prompt that every rank would compute, saying why with the figures', () => {
    const prompt = Array.from({ length: 400 }, (_, k) => 1000 + k);
    const seqs = Array.from({ length: 8 }, (_, i) => prompt.concat(Array.from({ length: 50 }, (_, k) => 10 * i + k)));
    const plan = planMicroBatches(csr(seqs), { maxTokens: 200, dp: 4, prefixCacheTokens: 1000 });
    const c = plan.choice!;
    expect(c.mode).toBe('shared');
    const [dp, shared] = c.candidates;
    expect(dp.computed_tokens).toBe(plan.optimumTokens + 3 * 400);
    expect(shared.computed_tokens).toBe(plan.optimumTokens);
    expect(shared.time).toBeLessThan(dp.time!);
    expect(c.why).toMatch(/^shared: time .* against dp /);
  });

  it('splits a tree whose cached chain does not fit one rank over a context-parallel group', () => {
    const r = rng(9);
    const seqs = [Array.from({ length: 400 }, () => Math.floor(r() * 50))];
    const plan = planMicroBatches(csr(seqs), { maxTokens: 50, dp: 4, prefixCacheTokens: 100, cp: 4 }, ['long']);
    const c = plan.choice!;
    expect([c.mode, c.cp]).toEqual(['cp', 4]);
    expect(c.candidates.filter((x) => x.refused).map((x) => [x.mode, x.cp])).toEqual([
      ['dp', 1],
      ['shared', 1],
      ['cp', 2],
    ]);
    const busy = plan.microBatches.filter((m) => m.sequences.length > 0);
    for (const m of busy) {
      expect(m.cpRanks).toEqual([0, 1, 2, 3]);
      expect(m.rank).toBe(0);
      expect(m.computedTokens).toBeLessThanOrEqual(4 * 50);
      expect(m.prefix!.tokens).toBeLessThanOrEqual(4 * 100);
    }
    expect(plan.prefixReuse!.computedTokens).toBe(400);
  });

  it('refuses a tree no plan can train, naming its record and sizes', () => {
    const r = rng(9);
    const seqs = [Array.from({ length: 400 }, () => Math.floor(r() * 50)), [1, 2, 3]];
    const e = caught(() =>
      planMicroBatches(csr(seqs), { maxTokens: 50, dp: 4, prefixCacheTokens: 100, cp: 2 }, ['long', 'short']),
    ) as TreepackError;
    expect(e).toBeInstanceOf(TreepackError);
    expect(e.code).toBe('E_ARG');
    expect(e.where.record).toBe('long');
    expect(e.message).toMatch(/no parallel plan can train this step within the budget/);
    expect(e.message).toMatch(/cp over 2 ranks: the step plan needs \d+ cached prefix tokens .*the sequence has 400 tokens.*allows 200/);
    expect(e.message).toMatch(/--cp up to 4 may fit it/);
  });

  it('checks its options', () => {
    const seqs = [[1, 2, 3]];
    expect((caught(() => planMicroBatches(csr(seqs), { maxTokens: 8, dp: 4, prefixCacheTokens: 8, cp: 5 })) as Error).message).toMatch(
      /cp/,
    );
    expect((caught(() => planMicroBatches(csr(seqs), { maxTokens: 8, dp: 2, cp: 2 })) as Error).message).toMatch(/without prefix reuse/);
    expect(
      (caught(() => planMicroBatches(csr(seqs), { maxTokens: 8, prefixCacheTokens: 8, linkBytesPerToken: 0 })) as Error).message,
    ).toMatch(/linkBytesPerToken/);
  });
});
