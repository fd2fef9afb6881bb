/**
 * `treepack pack`: writes micro-batches and a manifest. Everything goes to a staging directory first and is
 * moved into place only when the whole input was read without error, so bad input never leaves partial files
 * and never replaces a previous run's output.
 */
import { mkdirSync, readdirSync, renameSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { TreepackError } from '../errors.js';
import { writeFileAtomic } from '../io/atomic.js';
import { writeMicroBatch } from '../io/microbatch.js';
import { maskTensors } from '../io/masks.js';
import { MASKS_OPTION_HELP, parseMaskSpecs } from './masks.js';
import { DEFAULT_COST, imbalance } from '../pack/balance.js';
import { ADVANTAGE_ESTIMATORS, type AdvantageEstimator } from '../loss/advantages.js';
import { backendOption, nonNegativeNumber, oneInput, parse, PIPELINE_OPTIONS, pipelineOptions, positiveInt, type Parsed } from './args.js';
import { DEFAULT_MAX_NAIVE_TOKENS, emptyStats, packStream } from './pipeline.js';
import { progressReporter } from './progress.js';

export const PACK_USAGE = `Usage: treepack pack <input.jsonl|-> --out DIR [options]

Reads agent rollouts (chat episodes, chat records, pre-tokenized or slime samples; JSONL) and writes
prefix-tree packed micro-batches: DIR/microbatch-00000.safetensors … and DIR/manifest.json.

Options:
  --out DIR               output directory (created if missing)            [required]
  --tokenizer DIR         tokenizer.json + tokenizer_config.json            [default: Qwen3]
  --backend NAME          packer backend: auto, cpu, js                     [default: auto]
  --max-naive-tokens T    start a new micro-batch at the next group once T naive tokens are gathered
                                                                            [default: ${DEFAULT_MAX_NAIVE_TOKENS}]
  --vocab-size V          reject token ids >= V in pre-tokenized input
  --max-tokens T          split each cut into micro-batches of at most T packed tokens (padding included),
                          keeping shared prefixes together; a cut is then a window of groups
  --dp K                  data-parallel ranks: micro-batches per window are a multiple of K, balanced
                          by cost over the ranks (manifest: rank, step)                    [default: 1]
  --pad-multiple P        pad each micro-batch's packed length to a multiple of P          [default: 1]
  --pad-id ID             token id of pad nodes                                            [default: 0]
  --cost-token A          cost per packed token                                            [default: ${DEFAULT_COST.a}]
  --cost-pair B           cost per attention pair under the tree mask                      [default: ${DEFAULT_COST.b}]
  --balance-slack F       with --dp > 1, subtrees move between ranks to lower the slowest one, adding at
                          most this fraction of packed tokens (0: none; where T >= 4x the longest sequence,
                          never past 5% of the optimum if that is reachable)                 [default: 0.01]
  --no-merge              pack every record as its own sample (no timeline merge)
  --timeline-compare-level L
                          timeline merge compares messages by text or token [default: text]
  --advantages NAME       estimator for samples with a reward and no advantages: grpo, dr-grpo, rloo,
                          reinforce++-baseline, none (per group = task id, one value per episode broadcast
                          to all its turns; groups are then never split)    [default: grpo]
  --masks LIST            add attention-mask lowerings to every micro-batch, comma-separated:
                          ${MASKS_OPTION_HELP}
                          e.g. --masks block:128,slices (tensors named as in README; block_size in the metadata)
  --mask-backend NAME     backend for the masks: auto, cuda, webgpu, cpu, js   [default: auto]
  --quiet                 no summary line
  -h, --help              this help`;

export interface ManifestEntry {
  file: string;
  sequences: number;
  naive_tokens: number;
  packed_tokens: number;
  /** with --max-tokens */
  rank?: number;
  step?: number;
  pad_tokens?: number;
  attention_pairs?: number;
  cost?: number;
}

const BUDGET_FLAGS = ['dp', 'pad-multiple', 'pad-id', 'cost-token', 'cost-pair', 'balance-slack'] as const;

function budgetOptions(values: Parsed['values']) {
  const maxTokens = positiveInt('--max-tokens', values['max-tokens'] as string | undefined);
  if (maxTokens === undefined) {
    const stray = BUDGET_FLAGS.find((f) => values[f] !== undefined);
    if (stray) throw new TreepackError('E_ARG', `--${stray} needs --max-tokens T (the per-micro-batch token budget)`);
    return undefined;
  }
  const padTokenId = values['pad-id'] === undefined ? 0 : Number(values['pad-id']);
  if (!Number.isSafeInteger(padTokenId) || padTokenId < 0) throw new TreepackError('E_ARG', `Expected a token id >= 0 for --pad-id but received ${JSON.stringify(values['pad-id'])}`);
  return {
    maxTokens,
    dp: positiveInt('--dp', values.dp as string | undefined, 1),
    padMultiple: positiveInt('--pad-multiple', values['pad-multiple'] as string | undefined, 1),
    padTokenId,
    cost: {
      a: nonNegativeNumber('--cost-token', values['cost-token'] as string | undefined, DEFAULT_COST.a),
      b: nonNegativeNumber('--cost-pair', values['cost-pair'] as string | undefined, DEFAULT_COST.b),
    },
    ...(values['balance-slack'] !== undefined && { balanceSlack: nonNegativeNumber('--balance-slack', values['balance-slack'] as string, 0) }),
  };
}

export const fileName = (i: number) => `microbatch-${String(i).padStart(5, '0')}.safetensors`;

function advantagesOption(v: string | undefined): AdvantageEstimator | 'none' {
  if (v === undefined) return 'grpo';
  if (v !== 'none' && !(ADVANTAGE_ESTIMATORS as readonly string[]).includes(v)) {
    throw new TreepackError('E_ARG', `Expected one of ${ADVANTAGE_ESTIMATORS.join(', ')}, none for --advantages but received ${JSON.stringify(v)}`);
  }
  return v as AdvantageEstimator | 'none';
}

export async function packCommand(argv: string[]): Promise<number> {
  const { values, positionals } = parse(
    argv,
    {
      ...PIPELINE_OPTIONS,
      out: { type: 'string' },
      masks: { type: 'string' },
      'mask-backend': { type: 'string' },
      advantages: { type: 'string' },
      quiet: { type: 'boolean' },
      'max-tokens': { type: 'string' },
      ...Object.fromEntries(BUDGET_FLAGS.map((f) => [f, { type: 'string' } as const])),
    },
    PACK_USAGE,
  );
  if (values.help) {
    console.log(PACK_USAGE);
    return 0;
  }
  const input = oneInput(positionals, PACK_USAGE);
  const out = values.out as string | undefined;
  if (!out) throw new TreepackError('E_ARG', `--out DIR is required\n\n${PACK_USAGE}`);
  const budget = budgetOptions(values);
  const opts = { ...pipelineOptions(values), budget, advantages: advantagesOption(values.advantages as string | undefined) };
  const masks = parseMaskSpecs((values.masks as string | undefined) ?? '');
  const maskBackend = backendOption(values['mask-backend'] as string | undefined, '--mask-backend');

  mkdirSync(out, { recursive: true });
  const staging = join(out, `.treepack-staging-${process.pid}`);
  mkdirSync(staging);
  const stats = emptyStats();
  const progress = progressReporter();
  const manifest: ManifestEntry[] = [];
  let maskReport: string[] = [];
  try {
    for await (const { batch, plan } of packStream(input, { ...opts, onProgress: progress.update }, stats)) {
      const file = fileName(manifest.length);
      const lowered = masks.length ? await maskTensors(batch, masks, maskBackend).catch((err: unknown) => {
        throw err instanceof TreepackError ? new TreepackError(err.code, err.message, { file }) : err;
      }) : undefined;
      if (lowered) maskReport = lowered.reports;
      writeMicroBatch(join(staging, file), batch, lowered?.tensors, lowered?.metadata);
      const entry: ManifestEntry = { file, sequences: batch.meta.num_sequences, naive_tokens: batch.meta.num_tokens_naive, packed_tokens: batch.meta.num_tokens_packed };
      if (plan && budget) {
        // Every window holds a multiple of K micro-batches, step-major, so the global step is the index ÷ K.
        Object.assign(entry, { rank: plan.rank, step: Math.floor(manifest.length / budget.dp!), pad_tokens: plan.padTokens, attention_pairs: plan.attentionPairs, cost: plan.cost });
      }
      manifest.push(entry);
    }
  } catch (err) {
    rmSync(staging, { recursive: true, force: true });
    throw err;
  } finally {
    progress.done();
  }
  // The manifest is the commit point: the old one goes before any file is replaced and the new one is written
  // last, so a crash while publishing leaves no manifest rather than one that contradicts the files.
  rmSync(join(out, 'manifest.json'), { force: true });
  for (const m of manifest) renameSync(join(staging, m.file), join(out, m.file));
  rmSync(staging, { recursive: true, force: true });
  const keep = new Set(manifest.map((m) => m.file));
  // A previous run may have written more micro-batches; they would contradict the new manifest.
  for (const f of readdirSync(out)) if (/^microbatch-\d+\.safetensors$/.test(f) && !keep.has(f)) rmSync(join(out, f));
  const doc = {
    format: 'treepack/1',
    input,
    tokenizer: stats.tokenizer,
    backend: stats.backend,
    ...(masks.length ? { masks: masks.map((m) => (m.kind === 'blocks' ? `block:${m.blockSize}` : m.kind)), mask_backend: maskReport } : {}),
    records: stats.read.lines,
    timelines: stats.timelines,
    absorbed: stats.absorbed,
    sequences: stats.samples,
    naive_tokens: stats.naiveTokens,
    packed_tokens: stats.packedTokens,
    ...(budget && {
      max_tokens: budget.maxTokens,
      dp: budget.dp,
      pad_multiple: budget.padMultiple,
      cost_model: budget.cost,
      optimum_tokens: stats.optimumTokens,
      rank_costs: stats.rankCosts,
      imbalance: imbalance(stats.rankCosts),
    }),
    micro_batches: manifest,
  };
  writeFileAtomic(join(out, 'manifest.json'), [Buffer.from(JSON.stringify(doc, null, 2) + '\n')]);
  if (!values.quiet) {
    const ratio = stats.packedTokens ? (stats.naiveTokens / stats.packedTokens).toFixed(2) : '-';
    console.error(
      `treepack: ${stats.samples} sequences from ${stats.read.lines} records (${stats.absorbed} of ${stats.timelines} timelines merged into others) → ${manifest.length} micro-batch(es) in ${out}: ` +
        `${stats.naiveTokens} naive → ${stats.packedTokens} packed tokens (${ratio}×)` +
        (budget ? `, ${(stats.packedTokens / Math.max(1, stats.optimumTokens)).toFixed(3)}× the single-forest optimum, rank imbalance ${imbalance(stats.rankCosts).toFixed(3)}` : '') +
        `; ${stats.backend}`,
    );
  }
  return 0;
}
