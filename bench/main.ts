/**
 * `npm run bench`: the main job on a built-in dataset, then on real trajectories when they are present.
 *
 * Per dataset: naive and packed tokens, compression, the time of each stage (read+parse, tokenize, pack), and
 * packer throughput against a plain copy measured in the same run (the machine is shared and noisy: ratios
 * within one run are the figures to trust). First of all, the training step (bench/step.ts): naive, merged and
 * packed steps of a Qwen3-shape model through the PyTorch trainer side. Options: --full (every workload and model,
 * the memory and step-plan sections, longer timing; the default run is the short one, a few minutes on a busy
 * 2-core laptop: the last line gives each section's seconds), --json FILE, --html FILE (default: next to the JSON,
 * else ./bench-report.html), --data FILE (tau-bench JSONL).
 */
import { accessSync, constants, existsSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { performance } from 'node:perf_hooks';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import {
  ChatEncoder,
  concatSequences,
  loadTokenizer,
  packRecords,
  toSequences,
  type PackReport,
  type Sample,
  type Sequences,
} from '../src/index.js';
import { disposeBackends, listBackends } from '../src/ops.js';
import { generateJsonlLines, generateTokenSamples } from './dataset.js';
import { benchMasks } from './masks.js';
import { benchCollectors, benchMicroBatch, type MicroBatchRow } from './microbatch.js';
import { benchLoss } from './loss.js';
import { benchImages } from './images.js';
import { benchMemory } from './memory.js';
import { measurePacker, type Timing } from './throughput.js';
import { compareMerges, loadTracked, printMergeRow, type MergeBenchRow } from './merge.js';
import { superviseDawnWarnings } from './dawn-warnings.js';
import { big, fmt, speed } from './format.js';
import { renderHtml } from './report.js';
import { benchContextParallel } from './context-parallel.js';
import { benchPrefixStep } from './prefix-step.js';
import { benchRoutes } from './routes.js';
import { benchStep, type StepSection } from './step.js';
import { benchTrainer } from './trainer.js';
import { benchTrlStep, type TrlStepSection } from './trl-step.js';
import { analyzeStep, type StepSummary } from './step-report.js';

await superviseDawnWarnings();
const { values } = parseArgs({
  options: { full: { type: 'boolean' }, json: { type: 'string' }, html: { type: 'string' }, data: { type: 'string' } },
});
const quick = values.full !== true;
const maxTime = quick ? 0.5 : 2;
const root = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const tauBench = values.data ?? resolve(root, '../shared/data/tau_bench_gpt4o_airline.jsonl');
const html = values.html ?? (values.json ? values.json.replace(/(\.json)?$/, '.html') : 'bench-report.html');
// Report paths are checked before the run, not after it (a --full run takes half an hour): parents are created.
for (const [flag, file] of [
  ['--json', values.json],
  ['--html', html],
] as const) {
  if (file === undefined) continue;
  try {
    mkdirSync(dirname(resolve(file)), { recursive: true });
    accessSync(dirname(resolve(file)), constants.W_OK);
  } catch (e) {
    console.error(`bench: ${flag} ${file}: cannot write there (${(e as Error).message})`);
    process.exit(2);
  }
}

interface DatasetReport {
  name: string;
  stats: PackReport;
  compression: number;
  throughputTokens: number;
  throughput: Timing[];
  microBatching: MicroBatchRow[];
}

/** Runs the pipeline on a file and gathers every sample's tokens for the packer timing. */
async function pipeline(file: string, merge = true): Promise<{ stats: PackReport; seqs: Sequences }> {
  const run = packRecords(file, { tokenizer: 'qwen3', advantages: 'none', ...(merge ? {} : { merge: false }) });
  const samples: Sample[] = [];
  for await (const mb of run) samples.push(...mb.samples);
  return { stats: run.report(), seqs: toSequences(samples) };
}

function printThroughput(t: Timing[]): void {
  const copy = t.find((x) => x.name === 'copy int32, fresh buffer')!;
  const nativeFresh = t.find((x) => x.name === 'native, fresh buffers');
  for (const x of t) {
    const vsCopy = x === copy ? 'baseline' : `${speed(copy.seconds, x.seconds)} than the copy`;
    const vsNative = x.name.startsWith('js') && nativeFresh ? `, ${speed(nativeFresh.seconds, x.seconds)} than native` : '';
    console.log(
      `    ${x.name.padEnd(28)} ${fmt(x.seconds * 1e3, 3).padStart(10)} ms ±${fmt(x.rme, 1).padStart(4)}%  ${big(x.tokensPerSecond).padStart(8)} tok/s  (${vsCopy}${vsNative})`,
    );
  }
}

function printDataset(r: Omit<DatasetReport, 'microBatching'>): void {
  const s = r.stats;
  console.log(`\n## ${r.name}`);
  console.log(`  records ${s.read.lines}, samples ${s.samples}, micro-batches ${s.microBatches}`);
  const n = (x: number) => x.toLocaleString('en-US');
  console.log(
    `  naive tokens ${n(s.timelineTokens)} (every call its own sample), merged ${n(s.naiveTokens)} (${s.timelines} timelines → ${s.samples} samples), packed ${n(s.packedTokens)}`,
  );
  console.log(
    `  compression ${fmt(r.compression)}× (naive ÷ packed; the timeline merge alone: ${fmt(s.timelineTokens / Math.max(1, s.naiveTokens))}×)`,
  );
  console.log(
    `  stages: read+parse ${fmt(s.seconds.readParse, 3)} s, tokenize ${fmt(s.seconds.tokenize, 3)} s, merge ${fmt(s.seconds.merge, 3)} s, pack ${fmt(s.seconds.pack, 3)} s  (${s.backend})`,
  );
  if (s.tokenizerCache) {
    const c = s.tokenizerCache;
    console.log(
      `  tokenizer cache: ${c.segments} segments, ${c.unique} tokenized (${fmt((100 * c.encodedChars) / Math.max(1, c.totalChars), 1)}% of ${big(c.totalChars)} chars)`,
    );
  }
  console.log(
    `  packer throughput (tokens in memory → all contract arrays), on the ${big(r.throughputTokens)} naive tokens before the merge:`,
  );
  printThroughput(r.throughput);
}

async function chatDataset(name: string, file: string): Promise<DatasetReport> {
  const { stats, seqs } = await pipeline(file);
  // The packer's own speed is measured on the calls before merging: the agent-shaped chains where request k+1
  // extends request k, which is what the packer meets when merging is off or impossible.
  const unmerged = (await pipeline(file, false)).seqs;
  const report = {
    name,
    stats,
    compression: stats.timelineTokens / Math.max(1, stats.packedTokens),
    throughputTokens: unmerged.tokens.length,
    throughput: await measurePacker(unmerged, maxTime),
  };
  printDataset(report);
  return { ...report, microBatching: benchMicroBatch(name, seqs) };
}

/** Pre-tokenized agent-shaped samples built straight into typed arrays: the packer at scale, no tokenizer. */
function syntheticTokens(groups: number): Sequences {
  return concatSequences(Array.from(generateTokenSamples({ groups, seed: 7 }), (s) => s.tokens));
}

const t0 = performance.now();
/** Wall seconds per section, printed with the total: where the run's time went. */
const sections: [string, number][] = [];
async function timed<T>(name: string, run: () => T | Promise<T>): Promise<T> {
  const t = performance.now();
  try {
    return await run();
  } finally {
    sections.push([name, (performance.now() - t) / 1000]);
  }
}
console.log(`# treepack bench${quick ? ' (default run; --full for every workload)' : ' (--full)'}  node ${process.version}`);
const environment = [`node ${process.version}, ${process.platform} ${process.arch}`];
for (const b of await listBackends()) {
  const line = `backend ${b.name.padEnd(6)} ${b.available ? 'available' : 'unavailable'}: ${b.detail}; ops: ${b.ops.join(', ') || 'none yet'}`;
  console.log(`  ${line}`);
  environment.push(line);
}
await disposeBackends();

const tauPresent = existsSync(tauBench);
// The default file may be absent (skipped, with why); a file the user named with --data must exist: each section
// that reads it says FAILED naming it, the others still run, and the bench exits 1.
const tauAbsent =
  values.data === undefined ? `skipped, ${tauBench} not found (pass --data FILE)` : `FAILED, --data ${tauBench}: no such file`;
const stepData = tauPresent || values.data !== undefined ? tauBench : null;
const stepSection: StepSection = await timed('training step', () =>
  benchStep({ full: !quick, tauBench: stepData }).catch((e: Error) => ({ skipped: `failed: ${e.message}`, workloads: [] })),
);
let step: StepSummary | null = null;
if (stepSection.skipped) console.log(`\n## training step: skipped, ${stepSection.skipped}`);
else {
  step = analyzeStep(stepSection);
  console.log(`\n${step.text}`);
  environment.push(`training step: ${stepSection.device}, torch ${stepSection.torch}, Python ${stepSection.python}`);
}

const trlStep: TrlStepSection = await timed('TRL step', () =>
  benchTrlStep({ full: !quick, tauBench: stepData }).catch((e: Error) => ({ skipped: `failed: ${e.message}`, workloads: [] })),
);
console.log(`\n${trlStep.text ?? `## TRL GRPO step: skipped, ${trlStep.skipped}`}`);

const reports: DatasetReport[] = [];
const dir = mkdtempSync(join(tmpdir(), 'treepack-bench-'));
try {
  const groups = quick ? 4 : 16;
  const file = join(dir, 'generated.jsonl');
  writeFileSync(file, [...generateJsonlLines({ groups, seed: 1 })].join('\n') + '\n');
  const name = `generated chat episodes (${groups} groups × 8 episodes, Qwen3 template)`;
  reports.push(await timed('generated dataset', () => chatDataset(name, file)));
} finally {
  rmSync(dir, { recursive: true, force: true });
}
if (tauPresent) {
  // A malformed file is reported (the error names file and line) and the other sections still run.
  await timed('tau-bench dataset', () => chatDataset(`tau-bench airline, gpt-4o (${tauBench})`, tauBench)).then(
    (r) => reports.push(r),
    (e: Error) => {
      console.log(`\n## tau-bench: FAILED, ${e.message}`);
      process.exitCode = 1;
    },
  );
} else {
  console.log(`\n## tau-bench: ${tauAbsent}`);
}

const bigGroups = quick ? 8 : 64;
const seqs = syntheticTokens(bigGroups);
const M = seqs.tokens.length;
console.log(
  `\n## packer at scale: generated pre-tokenized samples (${bigGroups} groups × 8 episodes, ${seqs.offsets.length - 1} samples, ${big(M)} naive tokens)`,
);
const scale = await timed('packer at scale', () => measurePacker(seqs, maxTime));
printThroughput(scale);

/** Timeline merge against the AgentJet-style greedy pairwise merge, on the same timelines (bench/merge.ts). */
async function mergeSection(): Promise<MergeBenchRow[]> {
  const rows: MergeBenchRow[] = [];
  const encoder = new ChatEncoder(await loadTokenizer('qwen3'));
  const groups = quick ? 8 : 64; // 64 groups × 8 episodes ≈ 10k timelines
  const mdir = mkdtempSync(join(tmpdir(), 'treepack-bench-merge-'));
  const sets: [string, string][] = [];
  try {
    const file = join(mdir, 'generated.jsonl');
    writeFileSync(file, [...generateJsonlLines({ groups, seed: 11 })].join('\n') + '\n');
    sets.push([`generated chat episodes (${groups} groups × 8 episodes)`, file]);
    if (tauPresent) sets.push([`tau-bench airline, gpt-4o`, tauBench]);
    for (const [name, f] of sets) {
      const tracked = await loadTracked(f, encoder).catch((e: Error) => {
        console.log(`\n## timeline merge: ${name}: FAILED, ${e.message}`);
        process.exitCode = 1;
        return null;
      });
      if (!tracked) continue;
      console.log(`\n## timeline merge: ${name}`);
      for (const pool of [false, true]) {
        const row = compareMerges(name, tracked, pool, quick ? 1 : 3);
        printMergeRow(row);
        rows.push(row);
      }
    }
  } finally {
    rmSync(mdir, { recursive: true, force: true });
  }
  if (!tauPresent) console.log(`\n## timeline merge on tau-bench: ${tauAbsent}`);
  return rows;
}

const merge = await timed('timeline merge', mergeSection);
const collectors = await timed('micro-batch collectors', benchCollectors);
const images = await timed('images', () => benchImages(quick));
const loss = await timed('loss', () => benchLoss({ quick }));
const masks = await timed('masks', () => benchMasks(quick, syntheticTokens));
const memory = await timed('memory', () => benchMemory(quick));
const trainer = await timed('trainer side', () => benchTrainer(!quick));
const prefixStep = await timed('step plans', () => benchPrefixStep(!quick));
const routes = await timed('MoE routes', () => benchRoutes(quick));
const contextParallel = await timed('context parallel', () => benchContextParallel(!quick));
await disposeBackends();

const perSection = sections.map(([name, s]) => `${name} ${fmt(s, 1)} s`).join(', ');
console.log(`\ntotal bench time ${fmt((performance.now() - t0) / 1000, 1)} s (${perSection})`);
const all = {
  sectionSeconds: Object.fromEntries(sections),
  step: stepSection,
  stepAnalysis: step?.rows,
  costModel: step && { rates: step.rates, error: step.modelError },
  datasets: reports,
  scale: { naiveTokens: M, samples: seqs.offsets.length - 1, throughput: scale },
  merge,
  collectors,
  images,
  loss,
  masks,
  memory,
  trainer,
  trlStep,
  prefixStep,
  routes,
  contextParallel,
};
if (values.json) writeFileSync(values.json, JSON.stringify(all, null, 2));
const page = await renderHtml(
  {
    title: `treepack bench${quick ? '' : ' (--full)'}`,
    generated: `generated ${new Date().toISOString()} by npm run bench${quick ? '' : ' -- --full'}`,
    environment,
    step: step
      ? {
          device:
            `${stepSection.device}, ${stepSection.dtype}, packed: ${stepSection.packedAttention ?? stepSection.attention}, ` +
            `naive: ${stepSection.naiveAttention ?? stepSection.attention}`,
          rows: step.rows,
        }
      : { skipped: stepSection.skipped ?? 'no result' },
    sparsity: masks.sparsity,
    loss,
    merge,
  },
  [...(step ? [step.text] : []), ...(trlStep.text ? [trlStep.text] : [])],
);
writeFileSync(html, page);
console.log(`report: ${resolve(html)}${values.json ? `, ${resolve(values.json)}` : ''}`);
if ((values.data !== undefined && !tauPresent) || stepSection.workloads.some((w) => w.error)) process.exitCode = 1;
const trlMismatches = trlStep.workloads.filter((w) => w.mismatch);
if (trlMismatches.length) {
  console.error(
    `bench: TRL's packed step disagrees with its stock step:\n  ${trlMismatches.map((w) => `${w.name}: ${w.mismatch}`).join('\n  ')}`,
  );
  process.exitCode = 2;
}
if (step?.lossMismatches.length) {
  console.error(
    `bench: ${step.lossMismatches.length} packed/merged step(s) disagree with their naive baseline's loss:\n  ${step.lossMismatches.join('\n  ')}`,
  );
  process.exitCode = 2;
}
