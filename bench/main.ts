/**
 * `npm run bench`: the main job on a built-in dataset, then on real trajectories when they are present.
 *
 * Per dataset: naive and packed tokens, compression, the time of each stage (read+parse, tokenize, pack), and
 * packer throughput against a plain copy measured in the same run (the machine is shared and noisy: ratios
 * within one run are the figures to trust). Options: --quick (smaller data, shorter timing), --json FILE.
 */
import { existsSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { performance } from 'node:perf_hooks';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { ChatEncoder, concatSequences, disposeBackends, listBackends, loadTokenizer, packRecords, toSequences, type PackReport, type Sample, type Sequences } from '../src/index.js';
import { generateJsonlLines, generateTokenSamples } from './dataset.js';
import { benchMasks } from './masks.js';
import { benchCollectors, benchMicroBatch, type MicroBatchRow } from './microbatch.js';
import { benchLoss } from './loss.js';
import { benchMemory } from './memory.js';
import { measurePacker, type Timing } from './throughput.js';
import { compareMerges, loadTracked, printMergeRow, type MergeBenchRow } from './merge.js';

const { values } = parseArgs({ options: { quick: { type: 'boolean' }, json: { type: 'string' }, data: { type: 'string' } } });
const quick = values.quick === true;
const maxTime = quick ? 0.5 : 2;
const root = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const tauBench = values.data ?? resolve(root, '../shared/data/tau_bench_gpt4o_airline.jsonl');

interface DatasetReport {
  name: string;
  stats: PackReport;
  compression: number;
  throughputTokens: number;
  throughput: Timing[];
  microBatching: MicroBatchRow[];
}

const fmt = (x: number, d = 2) => x.toFixed(d);
const big = (x: number) => (x >= 1e9 ? `${fmt(x / 1e9)}G` : x >= 1e6 ? `${fmt(x / 1e6)}M` : x >= 1e3 ? `${fmt(x / 1e3, 1)}k` : String(Math.round(x)));

/** Runs the pipeline on a file and gathers every sample's tokens for the packer timing. */
async function pipeline(file: string, merge = true): Promise<{ stats: PackReport; seqs: Sequences }> {
  const run = packRecords(file, { advantages: 'none', ...(merge ? {} : { merge: false }) });
  const samples: Sample[] = [];
  for await (const mb of run) samples.push(...mb.samples);
  return { stats: run.report(), seqs: toSequences(samples) };
}

function printThroughput(t: Timing[]): void {
  const copyFresh = t.find((x) => x.name === 'copy int32, fresh buffer')!;
  const copyReused = t.find((x) => x.name === 'copy int32, reused buffer')!;
  const nativeFresh = t.find((x) => x.name === 'native, fresh buffers');
  for (const x of t) {
    const base = x.name.includes('reused') ? copyReused : copyFresh;
    const vsCopy = x === base ? 'baseline' : `${fmt(x.seconds / base.seconds)}× the copy's time`;
    const vsNative = x.name.startsWith('js') && nativeFresh ? `, ${fmt(x.seconds / nativeFresh.seconds)}× native` : '';
    console.log(`    ${x.name.padEnd(28)} ${fmt(x.seconds * 1e3, 3).padStart(10)} ms ±${fmt(x.rme, 1).padStart(4)}%  ${big(x.tokensPerSecond).padStart(8)} tok/s  (${vsCopy}${vsNative})`);
  }
}

function printDataset(r: Omit<DatasetReport, 'microBatching'>): void {
  const s = r.stats;
  console.log(`\n## ${r.name}`);
  console.log(`  records ${s.read.lines}, samples ${s.samples}, micro-batches ${s.microBatches}`);
  const n = (x: number) => x.toLocaleString('en-US');
  console.log(`  naive tokens ${n(s.timelineTokens)} (every call its own sample), merged ${n(s.naiveTokens)} (${s.timelines} timelines → ${s.samples} samples), packed ${n(s.packedTokens)}`);
  console.log(`  compression ${fmt(r.compression)}× (naive ÷ packed; the timeline merge alone: ${fmt(s.timelineTokens / Math.max(1, s.naiveTokens))}×)`);
  console.log(`  stages: read+parse ${fmt(s.seconds.readParse, 3)} s, tokenize ${fmt(s.seconds.tokenize, 3)} s, merge ${fmt(s.seconds.merge, 3)} s, pack ${fmt(s.seconds.pack, 3)} s  (${s.backend})`);
  if (s.tokenizerCache) {
    const c = s.tokenizerCache;
    console.log(`  tokenizer cache: ${c.segments} segments, ${c.unique} tokenized (${fmt((100 * c.encodedChars) / Math.max(1, c.totalChars), 1)}% of ${big(c.totalChars)} chars)`);
  }
  console.log(`  packer throughput (tokens in memory → all contract arrays), on the ${big(r.throughputTokens)} naive tokens before the merge:`);
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
    throughput: measurePacker(unmerged, maxTime),
  };
  printDataset(report);
  return { ...report, microBatching: benchMicroBatch(name, seqs) };
}

/** Pre-tokenized agent-shaped samples built straight into typed arrays: the packer at scale, no tokenizer. */
function syntheticTokens(groups: number): Sequences {
  return concatSequences(Array.from(generateTokenSamples({ groups, seed: 7 }), (s) => s.tokens));
}

const t0 = performance.now();
console.log(`# treepack bench${quick ? ' (quick)' : ''}  node ${process.version}`);
for (const b of await listBackends()) {
  console.log(`  backend ${b.name.padEnd(6)} ${b.available ? 'available' : 'unavailable'}: ${b.detail}; ops: ${b.ops.join(', ') || 'none yet'}`);
}
await disposeBackends();

const reports: DatasetReport[] = [];
const dir = mkdtempSync(join(tmpdir(), 'treepack-bench-'));
try {
  const groups = quick ? 4 : 16;
  const file = join(dir, 'generated.jsonl');
  writeFileSync(file, [...generateJsonlLines({ groups, seed: 1 })].join('\n') + '\n');
  reports.push(await chatDataset(`generated chat episodes (${groups} groups × 8 episodes, Qwen3 template)`, file));
} finally {
  rmSync(dir, { recursive: true, force: true });
}
if (existsSync(tauBench)) {
  reports.push(await chatDataset(`tau-bench airline, gpt-4o (${tauBench})`, tauBench));
} else {
  console.log(`\n## tau-bench: skipped, ${tauBench} not found (pass --data FILE)`);
}

const bigGroups = quick ? 8 : 64;
const seqs = syntheticTokens(bigGroups);
const M = seqs.tokens.length;
console.log(`\n## packer at scale: generated pre-tokenized samples (${bigGroups} groups × 8 episodes, ${seqs.offsets.length - 1} samples, ${big(M)} naive tokens)`);
const scale = measurePacker(seqs, maxTime);
printThroughput(scale);

/** Timeline merge against the AgentJet-style greedy pairwise merge, on the same timelines (bench/merge.ts). */
async function mergeSection(): Promise<MergeBenchRow[]> {
  const rows: MergeBenchRow[] = [];
  const encoder = new ChatEncoder(await loadTokenizer());
  const groups = quick ? 8 : 64; // 64 groups × 8 episodes ≈ 10k timelines
  const mdir = mkdtempSync(join(tmpdir(), 'treepack-bench-merge-'));
  const sets: [string, string][] = [];
  try {
    const file = join(mdir, 'generated.jsonl');
    writeFileSync(file, [...generateJsonlLines({ groups, seed: 11 })].join('\n') + '\n');
    sets.push([`generated chat episodes (${groups} groups × 8 episodes)`, file]);
    if (existsSync(tauBench)) sets.push([`tau-bench airline, gpt-4o`, tauBench]);
    for (const [name, f] of sets) {
      const tracked = await loadTracked(f, encoder);
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
  if (!existsSync(tauBench)) console.log(`\n## timeline merge on tau-bench: skipped, ${tauBench} not found (pass --data FILE)`);
  return rows;
}

const merge = await mergeSection();
const collectors = benchCollectors();
const loss = await benchLoss({ quick });
const masks = await benchMasks(quick, syntheticTokens);
const memory = await benchMemory(quick);
await disposeBackends();

console.log(`\ntotal bench time ${fmt((performance.now() - t0) / 1000, 1)} s`);
if (values.json) {
  writeFileSync(values.json, JSON.stringify({ datasets: reports, scale: { naiveTokens: M, samples: seqs.offsets.length - 1, throughput: scale }, merge, collectors, loss, masks, memory }, null, 2));
}
