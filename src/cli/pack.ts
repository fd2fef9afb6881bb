/** `treepack pack`: flags → packRecords → DirectorySink (micro-batches + manifest.json) → a summary line. */
import { DirectorySink } from '../io/directory-sink.js';
import { imbalance } from '../pack/balance.js';
import { packRecords } from '../packer/index.js';
import { OPTION_TABLE } from '../packer/option-table.js';
import { helpLines, oneInput, optionFlags, optionHelp, packerOptions, parse, usageError } from './args.js';
import { progressReporter } from './progress.js';

export const PACK_USAGE = `Usage: treepack pack <input.jsonl|-> --out DIR [options]

Reads agent rollouts (chat episodes, chat records, pre-tokenized or slime samples; JSONL) and writes
prefix-tree packed micro-batches: DIR/manifest.json names the files DIR/gen-NNNNNN/microbatch-00000.safetensors …,
published atomically as a whole (docs/operations/output-directory.md).

Options:
${helpLines([
  { flag: '--out DIR', help: 'output directory (created if missing)', note: '[required]' },
  ...optionHelp(OPTION_TABLE),
  { flag: '--quiet', help: 'no summary line' },
  { flag: '-h, --help', help: 'this help' },
])}`;

const SIGNALS = ['SIGINT', 'SIGTERM', 'SIGHUP'] as const;

export async function packCommand(argv: string[]): Promise<number> {
  const { values, positionals } = parse(
    argv,
    { ...optionFlags(OPTION_TABLE), out: { type: 'string' }, quiet: { type: 'boolean' } },
    PACK_USAGE,
  );
  if (values.help) {
    console.log(PACK_USAGE);
    return 0;
  }
  const input = oneInput(positionals, PACK_USAGE);
  const out = values.out as string | undefined;
  if (!out) throw usageError(`--out DIR is required\n\n${PACK_USAGE}`);
  const opts = packerOptions(values, OPTION_TABLE);

  const progress = progressReporter();
  const run = packRecords(input, { ...opts, onProgress: progress.update });
  const sink = new DirectorySink(out);
  // Interrupted: remove the staging now rather than leave it for the next run, then die of the same signal.
  const interrupted = (signal: NodeJS.Signals) => {
    sink.abort();
    process.kill(process.pid, signal);
  };
  for (const signal of SIGNALS) process.once(signal, interrupted);
  let microBatches: number;
  try {
    microBatches = (await run.writeTo(sink)).micro_batches.length;
  } finally {
    progress.done();
    for (const signal of SIGNALS) process.removeListener(signal, interrupted);
    for (const note of sink.notes) console.error(`treepack pack: ${note}`);
  }
  const stats = run.report();
  if (!values.quiet) {
    const ratio = stats.packedTokens ? (stats.naiveTokens / stats.packedTokens).toFixed(2) : '-';
    console.error(
      `treepack: ${stats.samples} sequences from ${stats.read.lines} records (${stats.absorbed} of ${stats.timelines} timelines merged into others) → ${microBatches} micro-batch(es) in ${out}: ` +
        `${stats.naiveTokens} naive → ${stats.packedTokens} packed tokens (${ratio}×)` +
        (stats.budget
          ? `, ${(stats.packedTokens / Math.max(1, stats.optimumTokens)).toFixed(3)}× the single-forest optimum, rank imbalance ${imbalance(stats.rankCosts).toFixed(3)}`
          : '') +
        (stats.prefixReuse
          ? `; prefix reuse: ${stats.prefixReuse.computedTokens} tokens computed (${(stats.prefixReuse.computedTokens / Math.max(1, stats.optimumTokens)).toFixed(3)}× the optimum), ${stats.prefixReuse.pushedTokens} pushed, at most ${stats.prefixReuse.peakCachedTokens} cached per rank`
          : '') +
        `; ${stats.backend}`,
    );
  }
  return 0;
}
