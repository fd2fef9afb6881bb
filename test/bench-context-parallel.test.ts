/**
 * The bench's context-parallel section (bench/context-parallel.ts → bench/context_parallel.py): its report from a
 * result of known figures (ratios against the one-rank run, the goal line), and the harness end to end on a tree of
 * 256 tokens over 2 gloo ranks: the report's shape, every token computed by exactly one rank, the window layer
 * receiving fewer bytes than a fetch of the whole context. No timing is asserted.
 */
import { describe, expect, it } from 'vitest';
import { benchContextParallel, cpText, type CpResult } from '../bench/context-parallel.js';
import { pythonFor } from './helpers/python.js';

const py = pythonFor('test/bench-context-parallel.test.ts', 'torch');

describe('bench context-parallel report', () => {
  it('states ratios against the one-rank run and the goal, from the result alone', () => {
    const rank = (tokens: number, context: number) => ({
      tokens,
      context_tokens: context,
      saved_bytes: 2 ** 20,
      seconds: 1,
      received_bytes: 2 ** 19,
      sent_bytes: 2 ** 19,
      reduced_bytes: 2 ** 20,
      received_bytes_whole: 2 ** 20,
    });
    const r: CpResult = {
      tokens: 1000,
      ranks: 2,
      window: 8,
      one_rank: { saved_bytes: 2 ** 21, seconds: 2 },
      per_rank: [rank(520, 0), rank(480, 40)],
      token_share_max_over_ideal: 1.04,
      saved_share: [0.5, 0.5],
      kv_bytes_whole_row: 2 ** 22,
      step_seconds_max_rank_over_one_rank: 0.5,
    };
    const text = cpText(r);
    expect(text).toContain('a tree of 1000 tokens over 2 ranks vs one rank (tiny Qwen3, layer 0 sliding window 8)');
    expect(text).toContain("one rank: 2.00 MiB saved for backward, step 2.00 s; the row's K/V over all layers 4.00 MiB");
    expect(text).toContain("rank 1: 480 tokens (0.960× N/K), 40 context; received 0.50 MiB (0.125× the row's K/V");
    expect(text).toContain('1.00 MiB with the whole context fetched');
    expect(text).toContain('saved 1.00 MiB (0.500× one rank); step 1.00 s (0.50× one rank)');
    expect(text).toContain('goal: per-rank tokens within 10% of N/K met (largest 1.040×)');
    expect(cpText({ ...r, token_share_max_over_ideal: 1.2 })).toContain('MISSED');
  });
});

describe.skipIf(py.skipReason !== '')('bench context-parallel harness', () => {
  it('splits a small tree over 2 gloo ranks and reports every figure', { timeout: 300_000 }, async () => {
    const args = ['--ranks', '2', '--prompt', '64', '--branches', '3', '--branch', '64', '--window', '16'];
    const section = await benchContextParallel(false, args);
    expect(section.skipped).toBeUndefined();
    const r = section.result!;
    expect([r.tokens, r.ranks, r.window]).toEqual([256, 2, 16]);
    expect(r.per_rank).toHaveLength(2);
    expect(r.per_rank[0].tokens + r.per_rank[1].tokens).toBe(256);
    expect(r.per_rank[0].context_tokens).toBe(0);
    expect(r.per_rank[1].context_tokens).toBeGreaterThan(16); // rank 1 hangs under a context longer than the window
    expect(r.kv_bytes_whole_row).toBe(256 * 2 * 2 * 16 * 2 * 4); // N × layers × kv heads × head dim × (K, V) × float32
    for (const x of r.per_rank) {
      expect(x.saved_bytes).toBeGreaterThan(0);
      expect(x.received_bytes).toBeGreaterThan(0);
      expect(x.received_bytes).toBeLessThan(x.received_bytes_whole!); // the window layer fetches less
    }
    expect(r.saved_share).toHaveLength(2);
    expect(section.text).toContain('goal: per-rank tokens within 10% of N/K');
  });
});
