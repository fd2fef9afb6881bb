/**
 * Packer throughput: token arrays in memory → every contract array, in naive tokens per second, measured with
 * benchmark.js against the hardware limit measured in the same run: one copy of the naive int32 token stream into
 * a fresh buffer. Each forest packer runs as a user calls it (resolveKernel: input checked, fresh output arrays).
 */
import Benchmark from 'benchmark';
import { type Sequences } from '../src/index.js';
import { resolveKernel } from '../src/ops.js';

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
    out.push({
      name: b.name!,
      seconds: b.stats.mean,
      rme: b.stats.rme,
      samples: b.stats.sample.length,
      tokensPerSecond: tokens / b.stats.mean,
    });
  });
  return out;
}

export async function measurePacker(seqs: Sequences, maxTime: number): Promise<Timing[]> {
  const cases: [string, () => void][] = [['copy int32, fresh buffer', () => void seqs.tokens.slice()]];
  // The best packer here (the native addon when built; GPU backends have none), then the TypeScript reference.
  const best = await resolveKernel('packForest', 'auto');
  const js = await resolveKernel('packForest', 'js');
  for (const k of best.backend === 'js' ? [js] : [best, js]) {
    cases.push([`${k.backend === 'cpu' ? 'native' : k.backend}, fresh buffers`, () => void k.kernel(seqs)]);
  }
  return run(cases, seqs.tokens.length, maxTime);
}
