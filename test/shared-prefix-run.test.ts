/**
 * Shared prefixes executed in shares (docs/design.md §11): a plan written by `treepack pack --prefix-reuse --dp 3`
 * run by treepack.torch on three spawned gloo ranks (python/tests/trainer/shared_dir.py), each piece computed once
 * by its group, each rank its range; against every sequence in one unsplit forest (float64, tiny Qwen3; a tiny gpt-oss
 * for the sliding window). Costs: each piece node scored by the LM head once per group per pass, a window layer's
 * members fetching only the keys in their window (fewer bytes than fetching all the keys before their range).
 */
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { cli } from './helpers/cli.js';
import { pythonFor, pythonTests } from './helpers/python.js';
import { rng } from './helpers/sequences.js';

const py = pythonFor('test/shared-prefix-run.test.ts', 'torch');

interface Entry {
  rank: number;
  computed_tokens: number;
  pushed_tokens: number;
}
interface Piece {
  start: number;
  end: number;
  ranks: number[];
  ranges: [number, number][];
}
interface Pass {
  errors: ({ code: string | null; field: string | null; message: string } | null)[];
  loss: number;
  loss_diff: number;
  logprob_diff: number;
  grad_diff: number;
  same_sequences: boolean;
  ranks: { computed_tokens: number; pushed_tokens: number; exchanged_bytes: number; head_rows: number; piece_head_rows: number }[];
}

/** A stem of 24 tokens under four sub-stems of 16, each under three episodes of two turns: at 24 tokens × 3 ranks the
 * planner shares the stem over the three ranks and two sub-stems over two ranks each (rank 1 in both). */
function plan(dir: string): { entries: Entry[]; pieces: Piece[]; computed: number } {
  const r = rng(5);
  const tok = (n: number) => Array.from({ length: n }, () => Math.floor(r() * 90));
  const stem = tok(24);
  const lines: string[] = [];
  for (let g = 0; g < 4; g++) {
    const sub = stem.concat(tok(16));
    for (let e = 0; e < 3; e++) {
      let ep = sub.concat(tok(4));
      for (let t = 0; t < 2; t++) {
        ep = ep.concat(tok(6));
        lines.push(JSON.stringify({ id: `g${g}e${e}t${t}`, tokens: ep, advantages: ep.map(() => Math.round(r() * 8 - 4) / 4) }));
      }
    }
  }
  writeFileSync(join(dir, 'in.jsonl'), lines.join('\n') + '\n');
  const out = join(dir, 'out');
  const args = ['--max-tokens', '24', '--prefix-reuse', '1000', '--dp', '3', '--advantages', 'none', '--quiet'];
  const packed = cli(['pack', join(dir, 'in.jsonl'), '--out', out, ...args]);
  expect(packed.code, packed.stderr).toBe(0);
  const m = JSON.parse(readFileSync(join(out, 'manifest.json'), 'utf8'));
  return { entries: m.micro_batches, pieces: m.shared_prefixes, computed: m.computed_tokens };
}

describe.skipIf(py.skipReason !== '')('shared prefixes computed in shares over gloo ranks', () => {
  it(
    "give the unsplit forest's loss, logprobs and gradients, each rank computing what the manifest says (a hybrid's " +
      'too); skipping the gradient return differs, a failed rank is named on every other',
    { timeout: 600_000 },
    () => {
      const dir = mkdtempSync(join(tmpdir(), 'treepack-shared-'));
      const { entries, pieces, computed } = plan(dir);
      expect(pieces.filter((p) => p.ranks.length === 3).length).toBe(1);
      expect(pieces.filter((p) => p.ranks.length === 2).length).toBeGreaterThanOrEqual(2);
      const res = py.run(
        [join(pythonTests, 'trainer', 'shared_dir.py'), join(dir, 'out'), 'shares,no_return,window,window_whole,hybrid,fault'],
        {
          timeout: 590_000,
          env: { OMP_NUM_THREADS: '1' },
        },
      );
      expect(res.status, res.stderr.slice(-4000)).toBe(0);
      const got = JSON.parse(res.stdout.trim().split('\n').pop()!) as Record<string, Pass>;

      const shares = got.shares;
      expect(shares.errors).toEqual([null, null, null]);
      expect(shares.same_sequences).toBe(true);
      expect(shares.loss_diff).toBeLessThan(1e-10 * Math.max(1, Math.abs(shares.loss)));
      expect(shares.logprob_diff).toBeLessThan(1e-10);
      expect(shares.grad_diff).toBeLessThan(1e-10);
      // Per rank, the manifest's accounting: its micro-batches' own nodes, its own pushed segments (popped with grad)
      // and its range of each piece (pushed without grad, then recomputed with it).
      const want = [0, 1, 2].map((rank) => {
        const mine = entries.filter((e) => e.rank === rank);
        const own = mine.reduce((a, e) => a + e.pushed_tokens, 0);
        const ranges = pieces.reduce(
          (a, p) => (p.ranks.includes(rank) ? a + p.ranges[p.ranks.indexOf(rank)].reduce((x, y) => y - x) : a),
          0,
        );
        return { computed_tokens: mine.reduce((a, e) => a + e.computed_tokens, 0) + own + ranges, pushed_tokens: own + ranges };
      });
      expect(shares.ranks.map((x) => ({ computed_tokens: x.computed_tokens, pushed_tokens: x.pushed_tokens }))).toEqual(want);
      expect(shares.ranks.reduce((a, x) => a + x.computed_tokens, 0)).toBe(computed);
      for (const x of shares.ranks) expect(x.exchanged_bytes).toBeGreaterThan(0);
      // The LM head: member i of a piece scores the nodes whose parent row it computes, [a_i + 1, b_i + 1) (the first
      // member from the piece's start, a root having no score), twice (push, recomputation): each node once per group.
      const headRows = [0, 1, 2].map((rank) =>
        pieces.reduce((sum, p) => {
          const i = p.ranks.indexOf(rank);
          if (i < 0) return sum;
          const lo = i === 0 ? Math.max(p.start, 1) : p.ranges[i][0] + 1;
          const hi = i === p.ranks.length - 1 ? p.end : p.ranges[i][1] + 1;
          return sum + 2 * (hi - lo);
        }, 0),
      );
      expect(shares.ranks.map((x) => x.piece_head_rows)).toEqual(headRows);
      const once = pieces.reduce((a, p) => a + 2 * (p.end - Math.max(p.start, 1)), 0);
      expect(headRows.reduce((a, x) => a + x, 0)).toBe(once);

      // gpt-oss, a sliding layer of window 4: exact, and fewer bytes than fetching every key before the range.
      for (const mode of ['window', 'window_whole'] as const) {
        const w = got[mode];
        expect(w.errors).toEqual([null, null, null]);
        expect(w.loss_diff, mode).toBeLessThan(1e-10 * Math.max(1, Math.abs(w.loss)));
        expect(w.logprob_diff, mode).toBeLessThan(1e-10);
        expect(w.grad_diff, mode).toBeLessThan(1e-10);
      }
      const bytes = (m: Pass) => m.ranks.map((x) => x.exchanged_bytes);
      console.log(
        `shared pieces: exchanged bytes per rank ${JSON.stringify({ window: bytes(got.window), whole: bytes(got.window_whole) })}`,
      );
      got.window.ranks.forEach((x, r) => expect(x.exchanged_bytes).toBeLessThan(got.window_whole.ranks[r].exchanged_bytes));

      // Negative control: pieces dropped after the window instead of back-propagated.
      expect(got.no_return.logprob_diff).toBeLessThan(1e-10);
      expect(got.no_return.grad_diff).toBeGreaterThan(1e-3);

      // A hybrid (Gated DeltaNet): each range starts from the states the rank before handed over.
      expect(got.hybrid.errors).toEqual([null, null, null]);
      expect(got.hybrid.loss_diff).toBeLessThan(1e-10 * Math.max(1, Math.abs(got.hybrid.loss)));
      expect(got.hybrid.logprob_diff).toBeLessThan(1e-10);
      expect(got.hybrid.grad_diff).toBeLessThan(1e-10);

      // Rank 1 fails at the window's end; ranks 0 and 2, waiting on pieces they share with it, name the exchange.
      expect(got.fault.errors[1]!.message).toMatch(/rank 1 failed/);
      for (const r of [0, 2]) {
        expect(got.fault.errors[r]).toMatchObject({ code: 'E_BACKEND', field: 'context_parallel' });
        expect(got.fault.errors[r]!.message).toMatch(/shared piece \d+ \(data-parallel ranks \[(0, 1|1, 2)\]\) failed/);
      }
    },
  );
});
