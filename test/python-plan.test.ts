/**
 * One micro-batch planner: Python's plan_micro_batches (python/treepack/plan.py, whole groups) runs the cut program of
 * planMicroBatches (src/pack/budget.ts). With every sequence its own group and one rank, where both apply, they must
 * give the same micro-batches (the same sequences and packed tokens; TypeScript orders steps by cost, Python by plan
 * order, so they are compared as sets) on random windows and adversarial ones: duplicates, sequences that are
 * prefixes of others, one shared prompt, a budget equal to the longest sequence, a single chain. Skipped, with the
 * reason printed, where there is no Python with numpy or the wheel cannot be built (test/helpers/python.ts).
 */
import { describe, expect, it } from 'vitest';
import { planMicroBatches } from '../src/pack/budget.js';
import { pythonFor } from './helpers/python.js';
import { csr, randomBatch, rng } from './helpers/sequences.js';

const py = pythonFor('test/python-plan.test.ts', 'numpy');

interface Case {
  name: string;
  seqs: number[][];
  maxTokens: number;
}

function cases(): Case[] {
  const out: Case[] = [];
  const longest = (s: number[][]) => Math.max(1, ...s.map((x) => x.length));
  for (let seed = 1; seed <= 60; seed++) {
    const seqs = randomBatch(seed);
    const r = rng(seed * 7 + 3);
    const L = longest(seqs);
    // a budget between the longest sequence and a few times it: several micro-batches, cuts inside shared prefixes
    out.push({ name: `random ${seed}`, seqs, maxTokens: L + Math.floor(r() * 3 * L) });
  }
  const prompt = Array.from({ length: 12 }, (_, k) => 100 + k);
  const fan = Array.from({ length: 9 }, (_, k) => [...prompt, k, k + 1, k + 2]);
  out.push({ name: 'one shared prompt, budget the longest', seqs: fan, maxTokens: 15 });
  out.push({ name: 'one shared prompt, budget two answers', seqs: fan, maxTokens: 18 });
  out.push({
    name: 'duplicates',
    seqs: [
      [1, 2, 3],
      [1, 2, 3],
      [1, 2, 3],
      [4, 5],
      [4, 5],
      [1, 2, 3],
    ],
    maxTokens: 3,
  });
  const chain = Array.from({ length: 10 }, (_, k) => Array.from({ length: k + 1 }, (_, t) => t + 1));
  out.push({ name: 'a single chain (each sequence a prefix of the next)', seqs: chain, maxTokens: 10 });
  out.push({ name: 'prefixes and their extensions', seqs: [[1], [1, 2], [1, 2, 3], [1, 4], [5, 6, 7], [5], [5, 6]], maxTokens: 4 });
  out.push({ name: 'two prompts, each answer its own budget', seqs: [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 6], [7]], maxTokens: 6 });
  return out;
}

const PROGRAM = `
import json, sys
from treepack import plan_micro_batches
out = []
for case in json.load(sys.stdin):
    plan = plan_micro_batches(case["seqs"], max_tokens=case["maxTokens"])
    out.append({"micro_batches": [[m.sequences.tolist(), m.packed_tokens] for m in plan.micro_batches],
                "packed": plan.packed_tokens, "optimum": plan.optimum_tokens})
print(json.dumps(out))
`;

describe.skipIf(py.skipReason !== '')("one micro-batch planner (python/treepack/plan.py runs src/pack/budget.ts's cuts)", () => {
  it('gives the same micro-batches as planMicroBatches with single-sequence groups and one rank', { timeout: 300_000 }, () => {
    const all = cases();
    const res = py.run(['-c', PROGRAM], { input: JSON.stringify(all), timeout: 280_000 });
    expect(res.status, res.stderr.slice(-4000)).toBe(0);
    const got = JSON.parse(res.stdout) as { micro_batches: [number[], number][]; packed: number; optimum: number }[];
    expect(got).toHaveLength(all.length);
    let split = 0;
    all.forEach((c, k) => {
      const plan = planMicroBatches(csr(c.seqs), { maxTokens: c.maxTokens });
      const ts = plan.microBatches.map((m) => JSON.stringify([Array.from(m.sequences), m.packedTokens])).sort();
      const python = got[k].micro_batches.map((m) => JSON.stringify(m)).sort();
      expect(python, c.name).toEqual(ts);
      expect(got[k].optimum, c.name).toBe(plan.optimumTokens);
      if (plan.microBatches.length > 1) split++;
    });
    // the comparison is not vacuous: most windows are cut into several micro-batches
    expect(split).toBeGreaterThan(all.length / 2);
  });
});
