/**
 * The deep workload of the step plans (bench/prefix_step.py): one tree with a long trunk and many short branches
 * (≥ 50× compression) under a token budget a quarter of the tree, its step time on CPU run unsplit, as the plain
 * split and as the step plan with prefix reuse. Minutes (the plain split repeats the trunk in every micro-batch), so
 * only with --full.
 */
import { findPython, runBenchScript } from './python.js';

export interface PrefixStepResult {
  skipped?: string;
  workload?: Record<string, number>;
  tokens_computed?: Record<string, number>;
  seconds?: Record<string, number>;
  vs_unsplit?: Record<string, number>;
}

export async function benchPrefixStep(full: boolean): Promise<PrefixStepResult> {
  const title = '\n## step plans on a deep tree (CPU): unsplit forest vs plain split vs prefix reuse';
  if (!full) {
    console.log(`${title}: skipped (minutes; npm run bench -- --full, or python bench/prefix_step.py)`);
    return { skipped: 'not --full' };
  }
  const env = await findPython();
  if (!env.torch || !env.python) {
    console.log(`${title}: skipped, no Python with torch: ${env.reason}`);
    return { skipped: env.reason };
  }
  const run = runBenchScript<Required<PrefixStepResult>>(env.python, title, 'prefix_step.py', ['--repeats', '3']);
  if ('failed' in run) return { skipped: run.failed };
  const r = run.result;
  const w = r.workload;
  console.log(title);
  console.log(
    `  trunk ${w.trunk} + ${w.branches} branches × ${w.branch}: ${w.naive_tokens} naive → ${w.tree_tokens} tree tokens (${w.compression.toFixed(1)}×), T = ${w.max_tokens}; one thread, best of 3 interleaved`,
  );
  for (const k of ['unsplit', 'plain_split', 'prefix_plan'] as const) {
    console.log(
      `  ${k.padEnd(12)} ${r.seconds[k].toFixed(2).padStart(7)} s  ${r.vs_unsplit[k].toFixed(2)}× unsplit  tokens computed ${r.tokens_computed[k]}`,
    );
  }
  console.log(
    `  goal: step plan ≤1.25× unsplit ${r.vs_unsplit.prefix_plan <= 1.25 ? 'met' : 'MISSED'} (${r.tokens_computed.prefix_pushed} trunk tokens pushed without grad)`,
  );
  return r;
}
