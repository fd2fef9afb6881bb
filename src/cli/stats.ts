/** `treepack stats`: how much packing saves on an input, overall, per group and by branch depth. */
import { performance } from 'node:perf_hooks';
import { helpLines, oneInput, optionFlags, optionHelp, packerOptions, parse, positiveInt } from './args.js';
import { branchDepthHistogram, bucketLabel } from '../pack/shape.js';
import { toSequences } from '../pack/batch.js';
import { dpFloorTokens, planMicroBatches } from '../pack/budget.js';
import { keyByRoutes } from '../pack/routes.js';
import type { MicroBatch, Sequences } from '../pack/contract.js';
import type { Sample } from '../records/types.js';
import { packRecords, type PackReport } from '../packer/index.js';
import { OPTION_TABLE } from '../packer/option-table.js';
import { progressReporter } from './progress.js';
import { resolveKernel } from '../backend/index.js';
import type { Snap } from '../timeline/snap.js';

/** The packer's options that change what stats measures: not those that shape only the written files. */
export const STATS_OPTIONS = OPTION_TABLE.filter((e) => !e.output);

export const STATS_USAGE = `Usage: treepack stats <input.jsonl|-> [options]

Prints records, timelines and samples after the timeline merge, naive and packed tokens, compression
(naive ÷ packed), drifted messages, timeline snaps (contexts that extend no earlier context of their episode),
per-group figures, a histogram of the depths at which the prefix trees branch, and step plans: per token budget T
and rank count K, the tokens a plain split holds and those a step plan with prefix reuse computes (docs/concepts/micro-batching.md, "Step
plans"), each rank alone and with shared prefixes (docs/design.md §11), against the single-forest optimum and the
data-parallel floor of plans that keep each rank to itself (each rank that trains a sequence computes the prefix all
sequences share), with the most prefix tokens a rank holds cached.

Options:
${helpLines([
  { flag: '--json', help: 'one JSON object on stdout' },
  ...optionHelp(STATS_OPTIONS),
  { flag: '--groups K', help: 'groups listed in the text report', note: '[default: 10]' },
  { flag: '--plan-tokens T,…', help: 'token budgets of the step-plan table', note: '[default: 8192,32768,131072]' },
  { flag: '--plan-dp K,…', help: 'rank counts of the step-plan table', note: '[default: 1,8]' },
  { flag: '-h, --help', help: 'this help' },
])}`;

interface GroupStats {
  group: string;
  samples: number;
  naive_tokens: number;
  packed_tokens: number;
  compression: number;
}

interface StatsReport {
  input: string;
  records: number; // input lines
  timelines: number; // records read (an episode line holds one per request): timelines = samples + absorbed
  samples: number; // after merging
  absorbed: number;
  merged_tokens: number; // naive tokens of the samples after merging: what the micro-batches hold unpacked
  drifted_messages: number;
  snaps: number;
  snap_lost_tokens: number;
  snap_kinds: Record<string, number>;
  snap_list: Snap[]; // the first 100

  naive_tokens: number;
  packed_tokens: number;
  compression: number;
  micro_batches: number;
  tokenizer: string;
  backend: string;
  seconds: PackReport['seconds'] & { total: number };
  groups: GroupStats[];
  branch_depth_histogram: { depth: string; count: number }[];
  tokenizer_cache?: PackReport['tokenizerCache'];
  /** with MoE routes: what sharing the split costs (packed tokens without padding, split vs by tokens alone) */
  routes?: { policy: string; conflicts: number; split_tokens: number; unsplit_tokens: number };
  step_plans: StepPlanRow[];
  images?: ImageFigures;
}

/** The images of the input (present when it has any): what the vision encoder and the language model run. */
interface ImageFigures {
  /** image parts over all calls: vision-encoder runs of an unpacked trainer (once per image per call) */
  encoder_calls_naive: number;
  /** distinct images summed over micro-batches: the packed trainer's runs (once per distinct image per micro-batch) */
  encoder_calls_packed: number;
  /** distinct images of the whole input */
  distinct_images: number;
  /** placeholder tokens over all calls, and the nodes holding them in the micro-batches */
  naive_image_tokens: number;
  packed_image_tokens: number;
}

/** Adds a micro-batch's images to `f`: its samples' image parts and tokens, its distinct images and their nodes. */
function addImageFigures(f: ImageFigures, batch: MicroBatch, samples: readonly Sample[], seen: Set<string>): void {
  for (const s of samples)
    for (const { image } of s.images ?? []) {
      f.encoder_calls_naive++;
      f.naive_image_tokens += image.tokens;
    }
  const hashes = batch.meta.image_hashes ?? [];
  f.encoder_calls_packed += hashes.length;
  for (const h of hashes) seen.add(h);
  f.distinct_images = seen.size;
  if (batch.image_fills) for (let k = 3; k < batch.image_fills.length; k += 4) f.packed_image_tokens += batch.image_fills[k];
}

/** Summed over the input's windows. */
interface StepPlanRow {
  max_tokens: number;
  dp: number;
  optimum_tokens: number;
  /** the fewest tokens a data-parallel plan can compute on these ranks (dpFloorTokens): the optimum at K = 1 */
  dp_floor_tokens: number;
  /** packed tokens of the plain split; null where a sequence is longer than T (the plain split refuses it) */
  plain_tokens: number | null;
  /**
   * with prefix reuse and shared prefixes (docs/design.md §11, the default): run with grad, run without grad to fill
   * the caches, most cached on a rank at once
   */
  computed_tokens: number;
  /** run with grad by the same step plan with each rank computing the prefixes it hangs from alone (--no-shared-prefix) */
  computed_tokens_alone: number;
  pushed_tokens: number;
  peak_cached_tokens: number;
}

function stepPlans(windows: Sequences[], budgets: number[], ranks: number[]): StepPlanRow[] {
  const rows: StepPlanRow[] = [];
  for (const T of budgets) {
    for (const K of ranks) {
      const row: StepPlanRow = {
        max_tokens: T,
        dp: K,
        optimum_tokens: 0,
        dp_floor_tokens: 0,
        plain_tokens: 0,
        computed_tokens: 0,
        computed_tokens_alone: 0,
        pushed_tokens: 0,
        peak_cached_tokens: 0,
      };
      for (const seqs of windows) {
        const planned = planMicroBatches(seqs, { maxTokens: T, dp: K, prefixCacheTokens: 0x7fffffff });
        const alone = K > 1 ? planMicroBatches(seqs, { maxTokens: T, dp: K, prefixCacheTokens: 0x7fffffff, sharedPrefix: false }) : planned;
        const p = planned.prefixReuse!;
        row.optimum_tokens += planned.optimumTokens;
        row.dp_floor_tokens += dpFloorTokens(seqs, alone);
        row.computed_tokens += p.computedTokens;
        row.computed_tokens_alone += alone.prefixReuse!.computedTokens;
        row.pushed_tokens += p.pushedTokens;
        row.peak_cached_tokens = Math.max(row.peak_cached_tokens, p.peakCachedTokens);
        let longest = 0;
        for (let i = 0; i + 1 < seqs.offsets.length; i++) longest = Math.max(longest, seqs.offsets[i + 1] - seqs.offsets[i]);
        const plain = longest <= T ? planMicroBatches(seqs, { maxTokens: T, dp: K }) : null;
        row.plain_tokens =
          plain && row.plain_tokens !== null ? row.plain_tokens + plain.microBatches.reduce((a, m) => a + m.packedTokens, 0) : null;
      }
      rows.push(row);
    }
  }
  return rows;
}

function intList(name: string, v: string | undefined, fallback: number[]): number[] {
  return v === undefined ? fallback : v.split(',').map((x) => positiveInt(name, x.trim())!);
}

const ratio = (a: number, b: number) => (b > 0 ? a / b : 0);

export async function statsCommand(argv: string[]): Promise<number> {
  const { values, positionals } = parse(
    argv,
    {
      ...optionFlags(STATS_OPTIONS),
      json: { type: 'boolean' },
      groups: { type: 'string' },
      'plan-tokens': { type: 'string' },
      'plan-dp': { type: 'string' },
    },
    STATS_USAGE,
  );
  if (values.help) {
    console.log(STATS_USAGE);
    return 0;
  }
  const input = oneInput(positionals, STATS_USAGE);
  const base = packerOptions(values, STATS_OPTIONS);
  // A diagnostic command: snap detection is worth its cost here.
  const opts = { ...base, merge: base.merge === false ? (false as const) : { ...base.merge, detectTimelineSnap: true } };
  const maxGroups = positiveInt('--groups', values.groups as string | undefined, 10)!;
  const planTokens = intList('--plan-tokens', values['plan-tokens'] as string | undefined, [8192, 32768, 131072]);
  const planDp = intList('--plan-dp', values['plan-dp'] as string | undefined, [1, 8]);
  const windows: Sequences[] = [];
  const progress = progressReporter();
  const histogram: number[] = [];
  const groups = new Map<string, Sample[]>();
  const t0 = performance.now();
  // No advantages: stats reports tokens, and need not refuse an input whose groups are not contiguous.
  const run = packRecords(input, { ...opts, advantages: 'none', onProgress: progress.update });
  const packer = await resolveKernel('packForest', opts.backend);
  const groupFigures = new Map<string, GroupStats>();
  const images: ImageFigures = {
    encoder_calls_naive: 0,
    encoder_calls_packed: 0,
    distinct_images: 0,
    naive_image_tokens: 0,
    packed_image_tokens: 0,
  };
  const seenImages = new Set<string>();
  // A group's own forest tells how much it shares internally. A group too large for one micro-batch is packed
  // in parts, and its figures are the sum of its parts: what the micro-batches really hold.
  const closeGroups = () => {
    for (const [group, samples] of groups) {
      const seqs = keyByRoutes(samples, toSequences(samples), opts.routeConflict ?? 'split', packer.kernel).seqs;
      const g = groupFigures.get(group) ?? { group, samples: 0, naive_tokens: 0, packed_tokens: 0, compression: 0 };
      g.samples += samples.length;
      g.naive_tokens += seqs.tokens.length;
      g.packed_tokens += packer.kernel(seqs).input_ids.length;
      g.compression = ratio(g.naive_tokens, g.packed_tokens);
      groupFigures.set(group, g);
    }
    groups.clear();
  };
  try {
    for await (const { batch, samples } of run) {
      branchDepthHistogram(batch, histogram);
      addImageFigures(images, batch, samples, seenImages);
      windows.push(keyByRoutes(samples, toSequences(samples), opts.routeConflict ?? 'split', packer.kernel).seqs);
      for (const s of samples) {
        const list = groups.get(s.group);
        if (list) list.push(s);
        else groups.set(s.group, [s]);
      }
      closeGroups();
    }
  } finally {
    progress.done();
  }
  const stats = run.report();
  const report: StatsReport = {
    input,
    records: stats.read.lines,
    timelines: stats.timelines,
    samples: stats.samples,
    absorbed: stats.absorbed,
    merged_tokens: stats.naiveTokens,
    drifted_messages: stats.driftedMessages,
    snaps: stats.snaps.count,
    snap_lost_tokens: stats.snaps.lostTokens,
    snap_kinds: stats.snaps.kinds,
    snap_list: stats.snaps.first,
    naive_tokens: stats.timelineTokens, // every call as its own sample: what an unpacked trainer runs
    packed_tokens: stats.packedTokens,
    compression: ratio(stats.timelineTokens, stats.packedTokens),
    micro_batches: stats.microBatches,
    tokenizer: stats.tokenizer,
    backend: stats.backend,
    seconds: { ...stats.seconds, total: (performance.now() - t0) / 1000 },
    groups: [...groupFigures.values()],
    branch_depth_histogram: histogram.map((count, k) => ({ depth: bucketLabel(k), count })),
    tokenizer_cache: stats.tokenizerCache,
    ...(stats.routes && {
      routes: {
        policy: stats.routes.policy,
        conflicts: stats.routes.conflicts,
        split_tokens: stats.routes.splitTokens,
        unsplit_tokens: stats.routes.unsplitTokens,
      },
    }),
    step_plans: stepPlans(windows, planTokens, planDp),
    ...(images.encoder_calls_naive > 0 && { images }),
  };
  if (values.json) console.log(JSON.stringify(report));
  else console.log(formatStats(report, maxGroups));
  return 0;
}

function formatStats(r: StatsReport, maxGroups: number): string {
  const n = (x: number) => x.toLocaleString('en-US');
  const lines = [
    `input          ${r.input}`,
    `records        ${n(r.records)}`,
    `timelines      ${n(r.timelines)}`,
    `samples        ${n(r.samples)}  (${n(r.absorbed)} timelines merged into others)`,
    `drifted        ${n(r.drifted_messages)} messages (re-rendered tokens differ from the sampled ones)`,
    `snaps          ${n(r.snaps)}  (${n(r.snap_lost_tokens)} tokens of sharing lost${Object.entries(r.snap_kinds)
      .map(([k, c]) => `; ${k} ${c}`)
      .join('')})`,
    `naive tokens   ${n(r.naive_tokens)}  (every timeline as its own sample)`,
    `merged tokens  ${n(r.merged_tokens)}  (samples after the timeline merge)`,
    `packed tokens  ${n(r.packed_tokens)}  (${r.micro_batches} micro-batch${r.micro_batches === 1 ? '' : 'es'})`,
    `compression    ${r.compression.toFixed(2)}× (naive ÷ packed)`,
    ...(r.routes
      ? [
          `routes         ${n(r.routes.conflicts)} occurrences routed unlike their node's first; ${r.routes.policy === 'split' ? `split: ${n(r.routes.split_tokens)} packed tokens vs ${n(r.routes.unsplit_tokens)} sharing by tokens alone (+${n(r.routes.split_tokens - r.routes.unsplit_tokens)})` : `first: ${n(r.routes.conflicts)} occurrences replay another sequence's routes`}`,
        ]
      : []),
    `tokenizer      ${r.tokenizer}`,
    `packer         ${r.backend}`,
    `time           ${r.seconds.total.toFixed(2)} s (read+parse ${r.seconds.readParse.toFixed(2)}, tokenize ${r.seconds.tokenize.toFixed(2)}, merge ${r.seconds.merge.toFixed(2)}, pack ${r.seconds.pack.toFixed(2)})`,
  ];
  if (r.images) {
    const im = r.images;
    lines.push(
      `images         ${n(im.distinct_images)} distinct; vision encoder runs ${n(im.encoder_calls_naive)} unpacked ` +
        `(once per image per call), ${n(im.encoder_calls_packed)} packed (once per distinct image per micro-batch)`,
      `image tokens   ${n(im.naive_image_tokens)} naive, ${n(im.packed_image_tokens)} packed ` +
        `(${ratio(im.naive_image_tokens, im.packed_image_tokens).toFixed(2)}×)`,
    );
  }
  if (r.groups.length) {
    const top = [...r.groups].sort((a, b) => b.naive_tokens - a.naive_tokens).slice(0, maxGroups);
    lines.push('', `groups (${r.groups.length}; largest ${top.length} by naive tokens)`);
    const w = Math.max(5, ...top.map((g) => g.group.length));
    lines.push(`  ${'group'.padEnd(w)}  samples      naive     packed  compression`);
    for (const g of top) {
      lines.push(
        `  ${g.group.padEnd(w)}  ${String(g.samples).padStart(7)}  ${String(g.naive_tokens).padStart(9)}  ${String(g.packed_tokens).padStart(9)}  ${g.compression.toFixed(2).padStart(10)}×`,
      );
    }
  }
  if (r.branch_depth_histogram.length) {
    lines.push('', 'branch depth (tokens before a branch starts)');
    const max = Math.max(...r.branch_depth_histogram.map((b) => b.count));
    // Agent data branches only after its shared prompt: leading empty buckets would be most of the chart.
    const first = r.branch_depth_histogram.findIndex((b) => b.count > 0);
    for (const b of r.branch_depth_histogram.slice(first)) {
      const bar = '#'.repeat(max ? Math.round((40 * b.count) / max) : 0);
      lines.push(`  ${b.depth.padStart(13)}  ${String(b.count).padStart(7)}  ${bar}`);
    }
  }
  if (r.step_plans.length) {
    lines.push('', 'step plans (tokens ÷ the single-forest optimum; prefix reuse: computed with grad by each rank alone, and with shared');
    lines.push('prefixes (the default: a prefix several ranks hang from computed once, in shares); pushed without grad, most cached');
    lines.push('per rank; DP floor: the fewest a plan keeping each rank to itself computes, each rank repeating the common prefix)');
    lines.push('       T    K   plain split   each rank alone   shared   DP floor   pushed   peak cached');
    for (const p of r.step_plans) {
      const opt = Math.max(1, p.optimum_tokens);
      const plain = p.plain_tokens === null ? 'infeasible' : `${(p.plain_tokens / opt).toFixed(3)}×`;
      lines.push(
        `  ${String(p.max_tokens).padStart(6)}  ${String(p.dp).padStart(3)}  ${plain.padStart(12)}  ${`${(p.computed_tokens_alone / opt).toFixed(3)}×`.padStart(16)}  ${`${(p.computed_tokens / opt).toFixed(3)}×`.padStart(7)}  ${`${(p.dp_floor_tokens / opt).toFixed(3)}×`.padStart(9)}  ${`${(p.pushed_tokens / opt).toFixed(3)}×`.padStart(7)}  ${n(p.peak_cached_tokens).padStart(12)}`,
      );
    }
  }
  return lines.join('\n');
}
