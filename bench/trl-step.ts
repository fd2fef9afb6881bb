/**
 * The TRL section of the training step: TRL's GRPO step with its stock forward vs treepack's packed one
 * (treepack.integrations.trl), on the step section's generated agent workloads (and the first tau-bench task with
 * --full), timed by bench/trl_step.py. Every LLM call is a TRL row; both sides train the same micro-batches with
 * TRL's own loss, so their losses must agree (a disagreement makes the bench exit 2).
 */
import { spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { generateJsonlLines } from './dataset.js';
import { fmt, mib } from './format.js';
import type { ModelShape } from './cost-model.js';
import { findPython, harnessAllocator, root } from './python.js';
import { GENERATED, mixedRewardTasks, packTo, STEP_SHAPES, withMixedRewards, type StepShapes } from './step.js';

interface TrlSide {
  micro_batches: number;
  step: number;
  steps: number[];
  loss_value: number;
  peak_bytes: number | null;
  tokens_per_second: number;
}

export interface TrlWorkload {
  name: string;
  /** every call's tokens; the padded rows' B × T; the forests' nodes */
  naive_tokens?: number;
  padded_tokens?: number;
  packed_tokens?: number;
  trainable_tokens?: number;
  sides?: Record<'stock' | 'packed', TrlSide>;
  mismatch?: string | null;
  skipped?: string;
}

export interface TrlStepSection {
  skipped?: string;
  device?: string;
  dtype?: string;
  torch?: string;
  trl?: string;
  shape?: ModelShape;
  workloads: TrlWorkload[];
  /** the section as printed */
  text?: string;
}

const MAX_TOKENS = 16384;

/** `generated`: the generated workloads (default: the step section's CPU-timed ones with `full`, else the first of
 * them, as the TRL section's stock side pads every call); `shapes`: the model per device (default the step section's
 * first). */
export async function benchTrlStep(opts: {
  full: boolean;
  tauBench: string | null;
  generated?: typeof GENERATED;
  shapes?: StepShapes;
}): Promise<TrlStepSection> {
  const env = await findPython();
  if (!env.torch || !env.python) return { skipped: `no Python with torch: ${env.reason}`, workloads: [] };
  const dir = mkdtempSync(join(tmpdir(), 'treepack-bench-trl-'));
  try {
    const workloads: object[] = [];
    // The CPU-timed generated workloads (a stock TRL step pads every call to the longest: the biggest ones are --full
    // only, and the default run times the smallest).
    const generated = (opts.generated ?? GENERATED).filter((g) => (opts.full || !g.full) && !g.devices);
    for (const g of opts.full || opts.generated ? generated : generated.slice(0, 1)) {
      const file = join(dir, `generated-${workloads.length}.jsonl`);
      writeFileSync(file, withMixedRewards([...generateJsonlLines(g.opts)]).join('\n') + '\n');
      const o = g.opts;
      workloads.push({
        name: `generated ${g.label} (${o.episodesPerGroup} episodes × ${o.minTurns}–${o.maxTurns} turns)`,
        file,
        repeats: opts.full ? g.repeats : 2,
      });
    }
    if (opts.tauBench && opts.full) {
      const file = join(dir, 'tau-bench.jsonl');
      const episodes = mixedRewardTasks(opts.tauBench, file, 1);
      workloads.push({ name: `tau-bench airline (first task with mixed rewards, ${episodes} episodes)`, file, repeats: 1 });
    }
    const spec = { shapes: opts.shapes ?? STEP_SHAPES, out_dir: join(dir, 'trl'), workloads: [] as object[] };
    for (const [i, w] of (workloads as { name: string; file: string; repeats: number }[]).entries()) {
      const callsDir = join(dir, `calls-${i}`);
      await packTo(w.file, callsDir, MAX_TOKENS, false);
      spec.workloads.push({ name: w.name, calls_dir: callsDir, repeats: w.repeats, max_tokens: MAX_TOKENS, devices: ['cpu', 'cuda'] });
    }
    const specFile = join(dir, 'spec.json');
    writeFileSync(specFile, JSON.stringify(spec));
    const r = spawnSync(env.python, [join(root, 'bench', 'trl_step.py'), specFile], {
      encoding: 'utf8',
      maxBuffer: 64 << 20,
      stdio: ['ignore', 'pipe', 'inherit'],
      env: { ...process.env, ...harnessAllocator().env },
    });
    if (r.status !== 0) return { skipped: `bench/trl_step.py exited with ${r.status ?? r.signal}`, workloads: [] };
    const section = JSON.parse(r.stdout) as TrlStepSection;
    return { ...section, text: trlStepText(section) };
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

/** The section's table: per workload the token figures, each side's step, throughput and peak, the speedup and
 * the speedup ÷ token compression (1 = the step got as much faster as the tokens got fewer). */
export function trlStepText(s: TrlStepSection): string {
  const sh = s.shape;
  const lines = [
    `## TRL GRPO step (trl ${s.trl}): stock forward vs treepack.integrations.trl, ${sh ? `random-weight ${sh.name} (hidden ${sh.hidden}, ${sh.layers} layers)` : ''} on ${s.device}, ${s.dtype}; every LLM call a TRL row, micro-batches ≤ ${MAX_TOKENS} tokens (stock: padded B × T; packed: forest nodes), loss dapo`,
  ];
  lines.push(
    '  tokens: naive (every call) / padded (TRL rows, B × T) / packed (forest nodes); peak: largest micro-batch, forward + backward',
  );
  for (const w of s.workloads) {
    if (w.skipped || !w.sides) {
      lines.push(`  ${w.name}: skipped: ${w.skipped ?? 'no result'}`);
      continue;
    }
    const { stock, packed } = w.sides;
    const compression = w.naive_tokens! / Math.max(1, w.packed_tokens!);
    const speedup = stock.step / packed.step;
    const peak = (b: number | null) => (b === null ? 'n/a' : `${mib(b)}`);
    lines.push(`  ${w.name}: tokens ${w.naive_tokens} / ${w.padded_tokens} / ${w.packed_tokens} (${fmt(compression)}× naive ÷ packed)`);
    lines.push(
      `    stock ${stock.micro_batches} micro-batches ${fmt(stock.step, 2)} s (${fmt(stock.tokens_per_second, 0)} tokens/s, peak ${peak(stock.peak_bytes)}) · packed ${packed.micro_batches} ${fmt(packed.step, 2)} s (${fmt(packed.tokens_per_second, 0)} tokens/s, peak ${peak(packed.peak_bytes)}) · speedup ${fmt(speedup)}×, ${fmt(speedup / compression, 2)} of the compression${w.mismatch ? ` · LOSS MISMATCH: ${w.mismatch}` : ''}`,
    );
  }
  return lines.join('\n');
}
