/**
 * The training-step section: workloads packed through the library (`packRecords` into a `DirectorySink`, once with
 * the timeline merge and once with every call its own sample), handed to the Python harness (bench/step.py) that
 * times naive, merged and packed steps of a random-weight Qwen3-shape model, then the cost model over the results.
 */
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { DirectorySink, packRecords, TreepackError, type PackReport } from '../src/index.js';
import { generateJsonlLines, type EpisodeJson, type GeneratorOptions } from './dataset.js';
import { QWEN3_4B, QWEN3_SHAPES, type ModelShape, type SideFigures } from './cost-model.js';
import { findPython, harnessAllocator, root } from './python.js';

export interface StepSide extends Record<string, unknown> {
  step: number;
  masks: number;
  forward: number;
  loss: number;
  backward: number;
  steps: number[];
  /** memory the side's largest micro-batch adds, forward + backward (bench/step.py peak_memory); null: not measurable here */
  peak_bytes: number | null;
  /** minor page faults during the side's timed steps, the most of any repeat (absent: older runs, or no getrusage) */
  page_faults?: number;
  /** the loss's value (`loss` is its seconds) */
  loss_value: number;
  /** merged only: the merge joined no call, so these are naive's sequences and naive's figures */
  same_as_naive?: boolean;
  /** a hybrid model: forward seconds in its recurrent layers (absent: none) */
  recurrent_forward?: number;
  /** the attention this side ran (bench/step.py path_name; older runs: absent) */
  attention?: string;
}

export interface StepWorkload {
  name: string;
  /** naive tokens (every call) ÷ packed tokens, from the packer's report */
  compression: number;
  packSeconds: number;
  report: PackReport;
  figures?: Record<'naive' | 'merged' | 'packed', SideFigures>;
  sides?: Record<'naive' | 'merged' | 'packed', StepSide & { logprob_sum: number; grad_norm: number }>;
  mismatches?: Record<string, string[]>;
  /** distinct token ids of the workload: the LM head's rows (bench/step.py remaps ids to them) */
  vocab?: number;
  /** the model this workload was timed on (one entry per workload and shape) */
  shape?: ModelShape;
  /** not timed here, and why (a workload for another device, a model the device has no memory for) */
  skipped?: string;
  error?: string;
}

export interface StepSection {
  skipped?: string;
  device?: string;
  deviceType?: string;
  dtype?: string;
  attention?: string;
  /** the attention the chain sides (naive, merged) and the packed side ran (older runs: absent) */
  naiveAttention?: string;
  packedAttention?: string;
  python?: string;
  /** the harness's CPU allocator settings (harnessAllocator) */
  allocator?: string;
  torch?: string;
  shape?: ModelShape;
  maxTokens?: number;
  workloads: StepWorkload[];
}

/** The CPU model: small enough for the default run, Qwen3's proportions (GQA 2:1, SwiGLU 3×). */
export const CPU_SHAPE: ModelShape = {
  name: 'tiny Qwen3 shape',
  hidden: 128,
  intermediate: 384,
  layers: 2,
  heads: 4,
  kv_heads: 2,
  head_dim: 32,
};

/** The hybrid CPU model: Qwen3.5's layout at the CPU model's width, three of every four layers Gated DeltaNet (their
 * recurrence run per radix segment and depth level on the packed side, treepack.torch.prepare). */
export const CPU_HYBRID_SHAPE: ModelShape = {
  ...CPU_SHAPE,
  name: 'tiny Qwen3.5 shape',
  family: 'qwen3_5',
  layers: 4,
  linear_layers: 3,
  linear_key_heads: 2,
  linear_value_heads: 4,
  linear_head_dim: 32,
};

/** The models the step is timed on, by the device the harness finds: every workload runs on each. (No hybrid shape on
 * CUDA yet: its torch fallback recurrence would time the fallback, not FLA's kernels, which no host here has.) */
export type StepShapes = Record<'cpu' | 'cuda', ModelShape[]>;
export const STEP_SHAPES: StepShapes = { cpu: [CPU_SHAPE, CPU_HYBRID_SHAPE], cuda: [QWEN3_SHAPES[0], QWEN3_4B] };
/** The default run's models: the hybrid CPU shape is --full only, as its torch fallback recurrence makes its steps
 * several times the attention-only shape's (a naive step of ~13 s against ~4 s at ≈4×): most of the default run. */
export const DEFAULT_STEP_SHAPES: StepShapes = { ...STEP_SHAPES, cpu: [CPU_SHAPE] };

interface WorkloadInput {
  name: string;
  file: string;
  repeats: number;
  maxTokens: number;
  devices?: ('cpu' | 'cuda')[];
}

/** Micro-batch budget of the step's layouts, unless a workload sets its own. */
const DEFAULT_MAX_TOKENS = 16384;

/** Timings per side in the default run: best of 2, as one timing of a ~2 s step can land on a burst of load. */
const DEFAULT_REPEATS = 2;

/**
 * Generated agent episodes whose shape sets the compression: group size and turns (long shared prefixes: a ~3.5k-token
 * policy prompt every call repeats). Naive tokens grow with the compression (≈ compression × packed tokens), so the
 * biggest workloads take the fewest repeats: `repeats` is the --full count (the default run: DEFAULT_REPEATS).
 * Each generated call adds ~90 tokens of its own, which bounds the compression near 40× with the ~3.5k-token policy;
 * ≈38× takes a ~7k-token policy (40 sections) and 2 calls per episode, 0.53M naive tokens, the most a --full naive
 * step affords on a 2-core CPU (~1.5 min). ≈85× (64 episodes sharing a ~25k-token policy, 3.1M naive tokens, a 36k-token
 * forest) is for CUDA hosts only (`devices`), with micro-batches of up to 64k tokens (`maxTokens`; 16k otherwise): its
 * naive step would take ~15 min on this CPU. It is packed everywhere (under a second) and reported skipped on CPU.
 */
export const GENERATED: {
  label: string;
  opts: GeneratorOptions;
  full?: boolean;
  repeats: number;
  maxTokens?: number;
  devices?: ('cpu' | 'cuda')[];
}[] = [
  { label: '≈4×', opts: { groups: 1, episodesPerGroup: 2, minTurns: 2, maxTurns: 2, truncateEvery: 0, seed: 3 }, repeats: 3 },
  { label: '≈5×', opts: { groups: 1, episodesPerGroup: 2, minTurns: 3, maxTurns: 4, truncateEvery: 0, seed: 3 }, repeats: 3 },
  { label: '≈12×', opts: { groups: 1, episodesPerGroup: 4, minTurns: 4, maxTurns: 6, truncateEvery: 0, seed: 3 }, full: true, repeats: 3 },
  { label: '≈23×', opts: { groups: 1, episodesPerGroup: 16, minTurns: 3, maxTurns: 4, truncateEvery: 0, seed: 3 }, full: true, repeats: 2 },
  { label: '≈30×', opts: { groups: 1, episodesPerGroup: 32, minTurns: 3, maxTurns: 3, truncateEvery: 0, seed: 3 }, full: true, repeats: 1 },
  {
    label: '≈38×',
    opts: { groups: 1, episodesPerGroup: 32, minTurns: 2, maxTurns: 2, truncateEvery: 0, seed: 3, policySections: 40 },
    full: true,
    repeats: 1,
  },
  {
    label: '≈85×',
    opts: { groups: 1, episodesPerGroup: 64, minTurns: 2, maxTurns: 2, truncateEvery: 0, seed: 3, policySections: 150 },
    full: true,
    repeats: 1,
    maxTokens: 65536,
    devices: ['cuda'],
  },
];

// The merge compares messages by tokens here, not by text (the library default): with text compare, a later call's
// context takes an earlier response's sampled tokens where its re-rendering drifted, so the merged and packed sides
// would train on other tokens than the naive side and the loss check could not hold (it failed on --full ≈12×–30×).
export async function packTo(file: string, out: string, maxTokens: number, merge: boolean): Promise<PackReport> {
  const run = packRecords(file, { tokenizer: 'qwen3', budget: { maxTokens }, merge: merge ? { timelineCompareLevel: 'token' } : false });
  await run.writeTo(new DirectorySink(out));
  return run.report();
}

/**
 * Generated episodes with the first episode's reward flipped in every group whose rewards are all equal (the generator
 * draws them at random, and a group of 2 agrees half the time): equal rewards give zero GRPO advantages, a zero loss
 * and zero gradients, and the step's equality check would prove nothing.
 */
export function withMixedRewards(lines: string[]): string[] {
  const episodes = lines.map((l) => JSON.parse(l) as EpisodeJson);
  const byTask = new Map<string, EpisodeJson[]>();
  for (const e of episodes) byTask.set(e.task_id, [...(byTask.get(e.task_id) ?? []), e]);
  for (const group of byTask.values()) {
    if (group.length > 1 && group.every((e) => e.meta.reward === group[0].meta.reward)) group[0].meta.reward = 1 - group[0].meta.reward;
  }
  return episodes.map((e) => JSON.stringify(e));
}

/**
 * The first `tasks` tasks of a tau-bench-style JSONL file whose episodes' rewards differ (equal rewards give zero
 * GRPO advantages: a zero loss and zero gradients would make the bench's equality check vacuous), written to `out`;
 * returns the episode count. One task is ~0.2M naive tokens; all five mixed ones of the airline file are 1.1M, a
 * naive step of many minutes on 2 cores. A missing file or a malformed line is a TreepackError naming it.
 */
export function mixedRewardTasks(file: string, out: string, tasks: number): number {
  let text: string;
  try {
    text = readFileSync(file, 'utf8');
  } catch (e) {
    throw new TreepackError('E_IO', `cannot read the tau-bench file: ${(e as Error).message}`, { file });
  }
  const byTask = new Map<string, { lines: string[]; rewards: Set<number> }>();
  for (const [i, line] of text.split('\n').entries()) {
    if (!line.trim()) continue;
    let r: { task_id?: string; group?: string; meta?: { reward?: number } };
    try {
      r = JSON.parse(line) as typeof r;
    } catch (e) {
      throw new TreepackError('E_INPUT', `malformed JSON: ${(e as Error).message}`, { file, line: i + 1 });
    }
    const key = String(r.task_id ?? r.group ?? byTask.size);
    const t = byTask.get(key) ?? { lines: [], rewards: new Set() };
    t.lines.push(line);
    t.rewards.add(r.meta?.reward ?? 0);
    byTask.set(key, t);
  }
  const kept = [...byTask.values()].filter((t) => t.rewards.size > 1).slice(0, tasks);
  if (!kept.length)
    throw new TreepackError('E_INPUT', 'no task has episodes with different rewards (meta.reward): nothing to train on', { file });
  writeFileSync(out, kept.flatMap((t) => t.lines).join('\n') + '\n');
  return kept.reduce((n, t) => n + t.lines.length, 0);
}

/** `generated`: the generated workloads to time (default GENERATED, the --full ones only with `full`); `shapes`: the
 * models per device (default STEP_SHAPES with `full`, else DEFAULT_STEP_SHAPES); `repeats`: timings per side of every
 * workload (default: the run's count);
 * `threads`: torch's CPU threads (default: torch's own choice); `naiveAttention`: the chain sides' attention (default
 * 'stock': the stock transformers path a trainer runs today; 'treepack': tree attention on the chains). */
export async function benchStep(opts: {
  full: boolean;
  tauBench: string | null;
  generated?: typeof GENERATED;
  shapes?: StepShapes;
  repeats?: number;
  threads?: number;
  naiveAttention?: 'stock' | 'treepack';
}): Promise<StepSection> {
  const maxTokens = DEFAULT_MAX_TOKENS;
  // A fresh clone gets its .venv made here.
  const env = await findPython();
  if (!env.torch || !env.python) return { skipped: `no Python with torch: ${env.reason}`, workloads: [] };
  const dir = mkdtempSync(join(tmpdir(), 'treepack-bench-step-'));
  try {
    const inputs: WorkloadInput[] = [];
    for (const g of (opts.generated ?? GENERATED).filter((g) => opts.full || !g.full)) {
      const file = join(dir, `generated-${inputs.length}.jsonl`);
      writeFileSync(file, withMixedRewards([...generateJsonlLines(g.opts)]).join('\n') + '\n');
      const o = g.opts;
      inputs.push({
        name: `generated ${g.label} (${o.episodesPerGroup} episodes × ${o.minTurns}–${o.maxTurns} turns)`,
        file,
        repeats: opts.repeats ?? (opts.full ? g.repeats : DEFAULT_REPEATS),
        maxTokens: g.maxTokens ?? maxTokens,
        devices: g.devices,
      });
    }
    const workloads: StepWorkload[] = [];
    const failed: StepWorkload[] = [];
    if (opts.tauBench && opts.full) {
      const file = join(dir, 'tau-bench.jsonl');
      try {
        const episodes = mixedRewardTasks(opts.tauBench, file, 1);
        inputs.push({ name: `tau-bench airline (first task with mixed rewards, ${episodes} episodes)`, file, repeats: 1, maxTokens });
      } catch (e) {
        // The generated workloads still run; the table shows this one FAILED with the error naming the file.
        failed.push({ name: 'tau-bench airline', compression: 0, packSeconds: 0, report: {} as PackReport, error: (e as Error).message });
      }
    }
    const spec = {
      max_tokens: maxTokens,
      shapes: opts.shapes ?? (opts.full ? STEP_SHAPES : DEFAULT_STEP_SHAPES),
      threads: opts.threads,
      naive_attention: opts.naiveAttention,
      workloads: [] as object[],
    };
    for (const [i, w] of inputs.entries()) {
      const packedDir = join(dir, `packed-${i}`),
        callsDir = join(dir, `calls-${i}`);
      const t0 = performance.now();
      const report = await packTo(w.file, packedDir, w.maxTokens, true);
      const packSeconds = (performance.now() - t0) / 1000;
      await packTo(w.file, callsDir, w.maxTokens, false);
      workloads.push({ name: w.name, compression: report.timelineTokens / Math.max(1, report.packedTokens), packSeconds, report });
      const mergedIsNaive = report.samples === report.timelines && report.naiveTokens === report.timelineTokens;
      spec.workloads.push({
        name: w.name,
        packed_dir: packedDir,
        calls_dir: callsDir,
        repeats: w.repeats,
        merged_is_naive: mergedIsNaive,
        max_tokens: w.maxTokens,
        devices: w.devices ?? ['cpu', 'cuda'],
      });
    }
    const specFile = join(dir, 'spec.json');
    writeFileSync(specFile, JSON.stringify(spec));
    const allocator = harnessAllocator();
    const r = spawnSync(env.python, [join(root, 'bench', 'step.py'), specFile], {
      encoding: 'utf8',
      maxBuffer: 64 << 20,
      stdio: ['ignore', 'pipe', 'inherit'],
      env: { ...process.env, ...allocator.env },
    });
    if (r.status !== 0) return { skipped: `bench/step.py exited with ${r.status ?? r.signal}`, workloads: [...workloads, ...failed] };
    const out = JSON.parse(r.stdout) as {
      device: string;
      device_type: 'cpu' | 'cuda';
      dtype: string;
      attention: string;
      naive_attention: string;
      packed_attention: string;
      torch: string;
      workloads: (Partial<StepWorkload> & { input: number; shape: ModelShape })[];
    };
    const shapes = spec.shapes[out.device_type];
    // One row per workload and model; the model's name leads when there are several.
    const timed = out.workloads.map((res) => ({
      ...workloads[res.input],
      name: shapes.length > 1 ? `${res.shape.name} · ${workloads[res.input].name}` : workloads[res.input].name,
      shape: res.shape,
      figures: res.figures,
      sides: res.sides,
      mismatches: res.mismatches,
      vocab: res.vocab,
      error: res.error,
      skipped: res.skipped,
    }));
    return {
      device: out.device,
      deviceType: out.device_type,
      dtype: out.dtype,
      attention: out.attention,
      naiveAttention: out.naive_attention,
      packedAttention: out.packed_attention,
      python: `${env.python} (${env.source})`,
      allocator: allocator.label,
      torch: out.torch,
      shape: shapes[0],
      maxTokens,
      workloads: [...timed, ...failed],
    };
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}
