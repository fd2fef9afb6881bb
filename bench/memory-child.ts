/**
 * Child processes of the memory bench (bench/memory.ts), so each peak RSS is one process's own:
 *   `gen BYTES`  writes generated pre-tokenized JSONL to stdout until BYTES are written;
 *   `pack DIR`   packs stdin into DIR as `treepack pack` does, and prints its figures and peak RSS as JSON.
 */
import { readFileSync } from 'node:fs';
import { DirectorySink, packRecords } from '../src/index.js';
import { generateTokenSamples } from './dataset.js';

/**
 * This process's peak RSS. On Linux, VmHWM of /proc/self/status: getrusage's maxRSS survives exec, so a child
 * spawned (forked) from a bench that already holds ~1 GB reported that 1 GB as its own.
 */
function peakRssBytes(): number {
  try {
    const kb = /^VmHWM:\s+(\d+) kB$/m.exec(readFileSync('/proc/self/status', 'utf8'))?.[1];
    if (kb) return Number(kb) * 1024;
  } catch {
    // not Linux: getrusage's figure is the one there is
  }
  return process.resourceUsage().maxRSS * 1024;
}

const [mode, arg] = process.argv.slice(2);
if (mode === 'gen') {
  const target = Number(arg);
  let generated = 0;
  let pending: string[] = [];
  const flush = async () => {
    const chunk = pending.join('');
    pending = [];
    if (!process.stdout.write(chunk)) await new Promise((r) => process.stdout.once('drain', r));
  };
  // Groups never repeat: an endless input of distinct groups, as a trainer's stream of rollouts.
  for (const s of generateTokenSamples({ groups: Number.MAX_SAFE_INTEGER, seed: 3 })) {
    if (generated >= target) break;
    const line = JSON.stringify(s) + '\n';
    generated += Buffer.byteLength(line);
    pending.push(line);
    if (pending.length >= 64) await flush();
  }
  await flush();
} else if (mode === 'pack') {
  const t0 = performance.now();
  const run = packRecords('-');
  const manifest = await run.writeTo(new DirectorySink(arg));
  const r = run.report();
  console.log(
    JSON.stringify({
      lines: r.read.lines,
      naiveTokens: r.naiveTokens,
      packedTokens: r.packedTokens,
      microBatches: manifest.micro_batches.length,
      seconds: (performance.now() - t0) / 1000,
      maxRssBytes: peakRssBytes(),
    }),
  );
} else {
  throw new Error(`usage: memory-child.ts gen BYTES | pack DIR`);
}
