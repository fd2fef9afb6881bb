/**
 * Packer throughput: token arrays in memory → every contract array, in naive tokens per second, measured with
 * benchmark.js against the hardware limit measured in the same run: one copy of the naive int32 token stream
 * into a fresh buffer and into a reused one.
 */
import Benchmark from 'benchmark';
import { loadNative, packForestNative, type ForestBuffers } from '../src/backend/native.js';
import { packForest, type Sequences } from '../src/index.js';

export interface Timing {
  name: string;
  seconds: number; // mean seconds per run
  rme: number; // relative margin of error, percent
  samples: number;
  tokensPerSecond: number;
}

function run(cases: [string, () => void][], tokens: number, maxTime: number): Timing[] {
  const suite = new Benchmark.Suite();
  for (const [name, fn] of cases) suite.add(name, fn, { maxTime, minSamples: 5 });
  suite.run({ async: false });
  const out: Timing[] = [];
  suite.forEach((b: Benchmark) => {
    out.push({ name: b.name!, seconds: b.stats.mean, rme: b.stats.rme, samples: b.stats.sample.length, tokensPerSecond: tokens / b.stats.mean });
  });
  return out;
}

export function measurePacker(seqs: Sequences, maxTime: number): Timing[] {
  const M = seqs.tokens.length;
  const reused = new Int32Array(M);
  const cases: [string, () => void][] = [
    ['copy int32, fresh buffer', () => void seqs.tokens.slice()],
    ['copy int32, reused buffer', () => reused.set(seqs.tokens)],
  ];
  if (!('error' in loadNative())) {
    // Node arrays never exceed M entries, so M-sized buffers fit every call.
    const out: ForestBuffers = {
      input_ids: new Int32Array(M),
      position_ids: new Int32Array(M),
      parent: new Int32Array(M),
      subtree_end: new Int32Array(M),
      seq_offsets: new Int32Array(seqs.offsets.length),
      seq_positions: new Int32Array(M),
    };
    cases.push(['native, fresh buffers', () => void packForestNative(seqs)]);
    cases.push(['native, reused buffers', () => void packForestNative(seqs, out)]);
  }
  cases.push(['js, fresh buffers', () => void packForest(seqs)]);
  return run(cases, M, maxTime);
}
