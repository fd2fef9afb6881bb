/**
 * Context parallelism on CPU (bench/context_parallel.py): one tree (a prompt and branches hanging from it) split over
 * K gloo ranks against the same tree on one rank, in the same run. Per rank: tokens computed against the ideal N/K,
 * bytes received against the whole row's K/V, activation memory (bytes saved for backward) and step time against the
 * one-rank run's; with a sliding-window layer, the bytes received against a fetch of the whole context. The default
 * run takes a 4k-token tree over 2 ranks; --full the 128k-token tree over 4 ranks (about two minutes per step).
 */
import { fmt } from './format.js';
import { findPython, runBenchScript } from './python.js';

export interface CpRank {
  tokens: number;
  context_tokens: number;
  saved_bytes: number;
  seconds: number;
  received_bytes: number;
  sent_bytes: number;
  reduced_bytes: number;
  received_bytes_whole: number | null;
}

export interface CpResult {
  tokens: number;
  ranks: number;
  window: number | null;
  one_rank: { saved_bytes: number; seconds: number };
  per_rank: CpRank[];
  token_share_max_over_ideal: number;
  saved_share: number[];
  kv_bytes_whole_row: number;
  step_seconds_max_rank_over_one_rank: number;
}

export interface CpSection {
  skipped?: string;
  args?: string[];
  result?: CpResult;
  text?: string;
}

/** The tree and ranks of each run: the default one small, --full the 128k tokens over 4 ranks. */
export const CP_ARGS = {
  quick: ['--ranks', '2', '--prompt', '512', '--branches', '7', '--branch', '512', '--window', '256'],
  full: ['--ranks', '4', '--prompt', '1024', '--branches', '127', '--branch', '1024', '--window', '512'],
};

const MB = (b: number) => `${fmt(b / 2 ** 20, 2)} MiB`;

/** The section's lines from a result: ratios against the one-rank run of the same result, then absolute numbers. */
export function cpText(r: CpResult): string {
  const ideal = r.tokens / r.ranks;
  const lines = [
    `\n## context parallelism (CPU, gloo): a tree of ${r.tokens} tokens over ${r.ranks} ranks vs one rank` +
      (r.window ? ` (tiny Qwen3, layer 0 sliding window ${r.window})` : ' (tiny Qwen3)'),
    `  one rank: ${MB(r.one_rank.saved_bytes)} saved for backward, step ${fmt(r.one_rank.seconds, 2)} s; ` +
      `the row's K/V over all layers ${MB(r.kv_bytes_whole_row)}`,
  ];
  r.per_rank.forEach((x, i) => {
    const window = x.received_bytes_whole === null ? '' : `, ${MB(x.received_bytes_whole)} with the whole context fetched`;
    lines.push(
      `  rank ${i}: ${x.tokens} tokens (${fmt(x.tokens / ideal, 3)}× N/K), ${x.context_tokens} context; received ${MB(x.received_bytes)} ` +
        `(${fmt(x.received_bytes / r.kv_bytes_whole_row, 3)}× the row's K/V${window}), reduced ${MB(x.reduced_bytes)}; ` +
        `saved ${MB(x.saved_bytes)} (${fmt(r.saved_share[i], 3)}× one rank); step ${fmt(x.seconds, 2)} s (${fmt(x.seconds / r.one_rank.seconds, 2)}× one rank)`,
    );
  });
  const met = r.token_share_max_over_ideal <= 1.1;
  lines.push(
    `  goal: per-rank tokens within 10% of N/K ${met ? 'met' : 'MISSED'} (largest ${fmt(r.token_share_max_over_ideal, 3)}×); ` +
      `slowest rank ${fmt(r.step_seconds_max_rank_over_one_rank, 2)}× the one-rank step (ranks share this host's cores)`,
  );
  return lines.join('\n');
}

/** Runs the section: `args` overrides the tree (the tests' smaller one). */
export async function benchContextParallel(full: boolean, args?: string[]): Promise<CpSection> {
  const title = '\n## context parallelism (CPU, gloo)';
  const env = await findPython();
  if (!env.torch || !env.python) {
    console.log(`${title}: skipped, no Python with torch: ${env.reason}`);
    return { skipped: `no Python with torch: ${env.reason}` };
  }
  const argv = args ?? (full ? CP_ARGS.full : CP_ARGS.quick);
  const run = runBenchScript<CpResult>(env.python, title, 'context_parallel.py', argv);
  if ('failed' in run) return { skipped: run.failed, args: argv };
  const result = run.result;
  const text = cpText(result);
  console.log(text);
  return { args: argv, result, text };
}
