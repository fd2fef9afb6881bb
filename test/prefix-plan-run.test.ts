/**
 * Step plans with prefix reuse through the processes that use them: `treepack stats`'s step-plan table, and a plan
 * written by `treepack pack` run by treepack.torch (the planner's own checks: test/prefix-plan.test.ts).
 */
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { packForest } from '../src/pack/forest.js';
import { cli } from './helpers/cli.js';
import { pythonFor, pythonTests } from './helpers/python.js';
import { agentBatch, csr, rng, toArrays } from './helpers/sequences.js';

describe('treepack stats: the step-plan table', () => {
  it('reports plain split and prefix reuse per budget and rank count', () => {
    const dir = mkdtempSync(join(tmpdir(), 'treepack-prefix-stats-'));
    const seqs = toArrays(agentBatch(4, { groups: 2, episodes: 4, turns: 4, prompt: 100, step: 30 }));
    writeFileSync(
      join(dir, 'in.jsonl'),
      seqs.map((tokens, i) => JSON.stringify({ id: `s${i}`, tokens, group: `g${i % 2}` })).join('\n') + '\n',
    );
    const longest = Math.max(...seqs.map((s) => s.length));
    const r = cli(['stats', join(dir, 'in.jsonl'), '--json', '--plan-tokens', `${longest - 1},${4 * longest}`, '--plan-dp', '1,2']);
    expect(r.code, r.stderr).toBe(0);
    const rows = JSON.parse(r.stdout).step_plans as {
      max_tokens: number;
      dp: number;
      optimum_tokens: number;
      dp_floor_tokens: number;
      plain_tokens: number | null;
      computed_tokens: number;
      computed_tokens_alone: number;
    }[];
    expect(rows.map((x) => [x.max_tokens, x.dp])).toEqual([
      [longest - 1, 1],
      [longest - 1, 2],
      [4 * longest, 1],
      [4 * longest, 2],
    ]);
    for (const x of rows) {
      expect(x.optimum_tokens).toBe(packForest(csr(seqs)).input_ids.length);
      if (x.dp === 1) expect(x.computed_tokens).toBe(x.optimum_tokens);
      if (x.dp === 1) expect(x.dp_floor_tokens).toBe(x.optimum_tokens);
      expect(x.computed_tokens_alone).toBeGreaterThanOrEqual(x.dp_floor_tokens);
      // Shared prefixes compute every node once per data-parallel group: the optimum.
      expect(x.computed_tokens).toBe(x.optimum_tokens);
      expect(x.plain_tokens === null).toBe(x.max_tokens < longest);
    }
  });
});

const py = pythonFor('test/prefix-plan-run.test.ts', 'torch');

describe.skipIf(py.skipReason !== '')('a written step plan run by treepack.torch', () => {
  // Qwen3 (attention only), Qwen3.5 (Gated DeltaNet + attention), Nemotron-H (Mamba2 + attention + MLP layers): the
  // recurrent layers' cached states at the planner's cuts (every branch of a micro-batch hangs from its chain's end).
  // Padded (--pad-multiple 4: pad roots after each micro-batch's computed nodes) for the hybrids.
  it.each([
    ['qwen3', 1],
    ['qwen3_5', 4],
    ['nemotron_h', 4],
  ])(
    "gives the unsplit forest's loss, logprobs and gradients (float64, tiny %s, pad multiple %i), computing what the manifest says",
    { timeout: 600_000 },
    (family, pad) => {
      const dir = mkdtempSync(join(tmpdir(), 'treepack-prefix-'));
      const r = rng(3);
      const tok = (n: number) => Array.from({ length: n }, () => Math.floor(r() * 90));
      const stem = tok(40);
      const lines: string[] = [];
      for (let e = 0; e < 5; e++) {
        let ep = stem.concat(tok(6));
        for (let t = 0; t < 4; t++) {
          ep = ep.concat(tok(8));
          lines.push(JSON.stringify({ id: `e${e}t${t}`, tokens: ep, group: 'g', advantages: ep.map(() => Math.round(r() * 8 - 4) / 4) }));
        }
      }
      lines.push(
        JSON.stringify({ id: 'short', tokens: stem.slice(0, 20).concat([1, 2, 3]), group: 'g', advantages: new Array(23).fill(0.25) }),
      );
      writeFileSync(join(dir, 'in.jsonl'), lines.join('\n') + '\n');
      const out = join(dir, 'out');
      const packed = cli([
        'pack',
        join(dir, 'in.jsonl'),
        '--out',
        out,
        '--max-tokens',
        '40',
        '--prefix-reuse',
        '1000',
        '--dp',
        '2',
        '--pad-multiple',
        String(pad),
        '--advantages',
        'none',
        '--quiet',
      ]);
      expect(packed.code, packed.stderr).toBe(0);
      const res = py.run([join(pythonTests, 'trainer', 'stepplan_dir.py'), out, family], {
        timeout: 590_000,
        env: { OMP_NUM_THREADS: '1' },
      });
      expect(res.status, res.stderr.slice(-4000)).toBe(0);
      const got = JSON.parse(res.stdout.trim().split('\n').pop()!);
      expect(got.same_sequences).toBe(true);
      expect(got.loss_diff).toBeLessThan(1e-10 * Math.max(1, Math.abs(got.loss)));
      expect(got.logprob_diff).toBeLessThan(1e-10);
      expect(got.grad_diff).toBeLessThan(1e-10);
      expect(got.pushed_tokens).toBeGreaterThan(0);
      expect(got.pad_tokens > 0).toBe(pad > 1);
      // The plan shares the stem between the two ranks (docs/design.md §11); this executor runs each rank's plan
      // alone, so each rank computes the shared pieces it holds itself: the manifest's figures, with each piece counted
      // once per rank of its group instead of once, and the pieces held beside the stack counted in the peak.
      const manifest = JSON.parse(readFileSync(join(out, 'manifest.json'), 'utf8')) as {
        shared_tokens: number;
        shared_prefixes: { start: number; end: number; ranks: number[] }[];
      };
      expect(manifest.shared_prefixes.length).toBeGreaterThan(0);
      const alone = manifest.shared_prefixes.reduce((a, p) => a + (p.end - p.start) * p.ranks.length, 0) - manifest.shared_tokens;
      expect({ computed_tokens: got.computed_tokens, pushed_tokens: got.pushed_tokens }).toEqual({
        computed_tokens: got.manifest.computed_tokens + alone,
        pushed_tokens: got.manifest.pushed_tokens + alone,
      });
      expect(got.peak_cached_tokens).toBeLessThanOrEqual(got.manifest.peak_cached_tokens);
    },
  );
});
