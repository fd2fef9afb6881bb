/** `treepack pack`: flags → packRecords → DirectorySink (micro-batches + manifest.json) → a summary line. */
import { DirectorySink } from '../io/directory-sink.js';
import { ADVANTAGE_ESTIMATORS, type AdvantageEstimator } from '../loss/advantages.js';
import { MASKS_OPTION_HELP, parseMaskSpecs } from '../io/masks.js';
import { DEFAULT_COST, imbalance } from '../pack/balance.js';
import { DEFAULT_WINDOW_TOKENS, packRecords } from '../packer/index.js';
import { backendOption, nonNegativeNumber, oneInput, optionValue, parse, PIPELINE_OPTIONS, pipelineOptions, positiveInt, usageError, type Parsed } from './args.js';
import { progressReporter } from './progress.js';

export const PACK_USAGE = `Usage: treepack pack <input.jsonl|-> --out DIR [options]

Reads agent rollouts (chat episodes, chat records, pre-tokenized or slime samples; JSONL) and writes
prefix-tree packed micro-batches: DIR/microbatch-00000.safetensors … and DIR/manifest.json.

Options:
  --out DIR               output directory (created if missing)            [required]
  --tokenizer DIR         tokenizer.json + tokenizer_config.json            [default: Qwen3]
  --backend NAME          packer backend: auto, cpu, js                     [default: auto]
  --max-naive-tokens T    start a new micro-batch at the next group once T naive tokens are gathered
                                                                            [default: ${DEFAULT_WINDOW_TOKENS}]
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
  --repeated-episode-ids  episode lines sharing an episode_id are parts of one episode (default: an error
                          naming both lines, unless the lines are identical)
  --lossy-utf8            read invalid UTF-8 as U+FFFD (default: an error naming line and byte offset)
  --advantages NAME       estimator for samples with a reward and no advantages: grpo, dr-grpo, rloo,
                          reinforce++-baseline, none (per group = task id, one value per episode broadcast
                          to all its turns; groups are then never split)    [default: grpo]
  --masks LIST            add attention-mask lowerings to every micro-batch, comma-separated:
                          ${MASKS_OPTION_HELP}
                          e.g. --masks block:128,slices (tensors named as in README; block_size in the metadata)
  --mask-backend NAME     backend for the masks: auto, cuda, webgpu, cpu, js   [default: auto]
  --quiet                 no summary line
  -h, --help              this help`;

const BUDGET_FLAGS = ['dp', 'pad-multiple', 'pad-id', 'cost-token', 'cost-pair', 'balance-slack'] as const;

function budgetOptions(values: Parsed['values']) {
  const maxTokens = positiveInt('--max-tokens', values['max-tokens'] as string | undefined);
  if (maxTokens === undefined) {
    const stray = BUDGET_FLAGS.find((f) => values[f] !== undefined);
    if (stray) throw usageError(`--${stray} needs --max-tokens T (the per-micro-batch token budget)`);
    return undefined;
  }
  const padTokenId = values['pad-id'] === undefined ? 0 : Number(values['pad-id']);
  if (!Number.isSafeInteger(padTokenId) || padTokenId < 0) throw usageError(`Expected a token id >= 0 for --pad-id but received ${JSON.stringify(values['pad-id'])}`);
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

function advantagesOption(v: string | undefined): AdvantageEstimator | 'none' {
  if (v === undefined) return 'grpo';
  if (v !== 'none' && !(ADVANTAGE_ESTIMATORS as readonly string[]).includes(v)) {
    throw usageError(`Expected one of ${ADVANTAGE_ESTIMATORS.join(', ')}, none for --advantages but received ${JSON.stringify(v)}`);
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
  if (!out) throw usageError(`--out DIR is required\n\n${PACK_USAGE}`);
  const budget = budgetOptions(values);
  const opts = { ...pipelineOptions(values), budget, advantages: advantagesOption(values.advantages as string | undefined) };
  const masks = optionValue(() => parseMaskSpecs((values.masks as string | undefined) ?? ''));
  const maskBackend = backendOption(values['mask-backend'] as string | undefined, '--mask-backend');

  const progress = progressReporter();
  const run = packRecords(input, { ...opts, masks, maskBackend, onProgress: progress.update });
  let microBatches: number;
  try {
    microBatches = (await run.writeTo(new DirectorySink(out))).micro_batches.length;
  } finally {
    progress.done();
  }
  const stats = run.report();
  if (!values.quiet) {
    const ratio = stats.packedTokens ? (stats.naiveTokens / stats.packedTokens).toFixed(2) : '-';
    console.error(
      `treepack: ${stats.samples} sequences from ${stats.read.lines} records (${stats.absorbed} of ${stats.timelines} timelines merged into others) → ${microBatches} micro-batch(es) in ${out}: ` +
        `${stats.naiveTokens} naive → ${stats.packedTokens} packed tokens (${ratio}×)` +
        (budget ? `, ${(stats.packedTokens / Math.max(1, stats.optimumTokens)).toFixed(3)}× the single-forest optimum, rank imbalance ${imbalance(stats.rankCosts).toFixed(3)}` : '') +
        `; ${stats.backend}`,
    );
  }
  return 0;
}
