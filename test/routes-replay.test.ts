/**
 * Routing replay end to end: pre-tokenized JSONL with MoE `routes` (an engine's, some calls' last token unrouted as
 * vLLM returns them, later calls rerouting part of the prompt they re-read) → `treepack pack` → treepack.torch loads
 * the routes into `batch.routes` → a tiny float64 Qwen3-MoE packed with replay equals every sequence unpacked with
 * its own routes (logprobs, aux loss, gradients, 1e-10), with and without route conflicts and through a step plan;
 * negative control: packed with `--route-conflict first` (shared by tokens) differs where routes conflict.
 */
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { cli } from './helpers/cli.js';
import { pythonFor, pythonTests } from './helpers/python.js';
import { rng } from './helpers/sequences.js';

const py = pythonFor('test/routes-replay.test.ts', 'torch');

/** Agent calls: per episode, call c re-reads call c − 1 and adds a turn; episodes share a prompt (vocabulary 61). */
function episodes(seed: number, conflicts: boolean): string[] {
  const r = rng(seed);
  const tok = (n: number) => Array.from({ length: n }, () => 1 + Math.floor(r() * 59));
  const prompt = tok(8);
  // The engine's route of a token is a function of its prefix (one forward), unless a later call rerouted it.
  const route = (prefix: number[]): number[][] => {
    const g = rng(prefix.reduce((h, t) => (Math.imul(h, 31) + t) | 0, 7));
    return [0, 1].map(() => {
      const a = Math.floor(g() * 4);
      return [a, (a + 1 + Math.floor(g() * 3)) % 4];
    });
  };
  const lines: string[] = [];
  for (let e = 0; e < 2; e++) {
    let ctx = prompt.concat(tok(3));
    for (let c = 0; c < 3; c++) {
      ctx = ctx.concat(tok(4));
      const rows = ctx.map((_, t) => {
        const rerouted = conflicts && c > 0 && r() < 0.25;
        return route(rerouted ? ctx.slice(0, t + 1).concat([1000 + c]) : ctx.slice(0, t + 1));
      });
      // vLLM routes seq_len − 1 tokens: the last generated token is never fed back
      const given = c % 2 ? rows.slice(0, -1) : rows;
      lines.push(JSON.stringify({ id: `e${e}c${c}`, group: 'g', tokens: ctx, routes: given }));
    }
  }
  return lines;
}

describe.skipIf(py.skipReason !== '')('MoE routes through treepack pack into treepack.torch', () => {
  it('packed with replay equals unpacked with replay, conflicts split; `first` differs', { timeout: 600_000 }, () => {
    const dir = mkdtempSync(join(tmpdir(), 'treepack-routes-replay-'));
    const dirs: string[] = [];
    const pack = (name: string, input: string, extra: string[]) => {
      const out = join(dir, name);
      const r = cli(['pack', input, '--out', out, '--advantages', 'none', '--quiet', ...extra]);
      expect(r.code, r.stderr).toBe(0);
      return out;
    };
    for (const conflicts of [false, true]) {
      const input = join(dir, `in-${conflicts}.jsonl`);
      writeFileSync(input, episodes(5, conflicts).join('\n') + '\n');
      dirs.push(pack(`split-${conflicts}`, input, []));
    }
    const conflicting = join(dir, 'in-true.jsonl');
    dirs.push(pack('first', conflicting, ['--route-conflict', 'first']));
    dirs.push('plan:' + pack('plan', conflicting, ['--max-tokens', '16', '--prefix-reuse', '1000']));
    const res = py.run([join(pythonTests, 'trainer', 'routes_dir.py'), ...dirs], { timeout: 590_000, env: { OMP_NUM_THREADS: '1' } });
    expect(res.status, res.stderr.slice(-4000)).toBe(0);
    const [agree, split, first, plan] = JSON.parse(res.stdout.trim().split('\n').pop()!) as Record<string, number>[];
    console.log(`routes replay: ${JSON.stringify({ agree, split, first, plan })}`);
    for (const r of [agree, split, plan]) {
      expect(r.logprob_diff).toBeLessThan(1e-10);
      expect(r.aux_diff).toBeLessThan(1e-10);
      expect(r.aux_compared).toBeGreaterThan(0); // the plan's too: run_step_plan(..., router=True)
      expect(r.grad_diff).toBeLessThan(1e-10);
    }
    expect(split.nodes).toBeGreaterThan(first.nodes); // the conflicts split the tree
    expect(split.nodes).toBeLessThan(split.occurrences); // and it still shares
    expect(plan.pushed_tokens).toBeGreaterThan(0); // micro-batches hung from cached, replayed prefixes
    expect(first.logprob_diff).toBeGreaterThan(1e-6); // negative control: one route per token, not per occurrence
  });
});
