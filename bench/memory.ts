/**
 * Memory of the streaming packer: peak RSS of one process packing generated pre-tokenized JSONL from stdin into
 * an output directory (as `treepack pack - --out DIR`), for an empty input (the process's fixed cost), ~100 MB and
 * ~1 GB. Memory is bounded by the window (4M naive tokens by default), not by the input: the 1 GB figure should be
 * close to the 100 MB one, not 10× it. Each size runs in fresh child processes (bench/memory-child.ts), the
 * generator in its own, so the figures are the packer's alone.
 */
import { spawn } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';

export interface MemoryRow {
  inputBytes: number;
  lines: number;
  naiveTokens: number;
  packedTokens: number;
  microBatches: number;
  seconds: number;
  maxRssBytes: number;
}

const CHILD = fileURLToPath(new URL('./memory-child.ts', import.meta.url));

function child(args: string[], stdin: 'ignore' | 'pipe') {
  return spawn(process.execPath, ['--import', 'tsx', CHILD, ...args], { stdio: [stdin, 'pipe', 'inherit'] });
}

async function measure(bytes: number, dir: string): Promise<MemoryRow> {
  const gen = child(['gen', String(bytes)], 'ignore');
  const pack = child(['pack', join(dir, `out-${bytes}`)], 'pipe');
  gen.stdout!.pipe(pack.stdin!);
  let out = '';
  pack.stdout!.on('data', (d) => (out += d));
  const exit = (p: ReturnType<typeof child>) => new Promise<number | null>((resolve) => p.on('close', resolve));
  const [g, k] = await Promise.all([exit(gen), exit(pack)]);
  if (g !== 0 || k !== 0) throw new Error(`memory bench child failed (generator exit ${g}, packer exit ${k})`);
  rmSync(join(dir, `out-${bytes}`), { recursive: true, force: true });
  return { inputBytes: bytes, ...(JSON.parse(out) as Omit<MemoryRow, 'inputBytes'>) };
}

const MB = 1e6;

export async function benchMemory(quick: boolean): Promise<MemoryRow[] | undefined> {
  if (quick) {
    console.log('\n## memory: skipped with --quick (peak RSS packing ~1 GB of JSONL takes a few minutes)');
    return undefined;
  }
  console.log('\n## memory: peak RSS of `pack` on generated pre-tokenized JSONL from stdin (one child process per size)');
  const dir = mkdtempSync(join(tmpdir(), 'treepack-bench-memory-'));
  const rows: MemoryRow[] = [];
  try {
    for (const bytes of [0, 100 * MB, 1000 * MB]) {
      const r = await measure(bytes, dir);
      rows.push(r);
      console.log(
        `  input ${(r.inputBytes / MB).toFixed(0).padStart(5)} MB: peak RSS ${(r.maxRssBytes / MB).toFixed(0).padStart(4)} MB` +
          `  (${r.lines} lines, ${r.naiveTokens.toLocaleString('en-US')} naive → ${r.packedTokens.toLocaleString('en-US')} packed tokens, ${r.microBatches} micro-batches, ${r.seconds.toFixed(1)} s)`,
      );
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
  const [empty, small, large] = rows;
  console.log(
    `  1 GB ÷ 100 MB: peak RSS ${(large.maxRssBytes / small.maxRssBytes).toFixed(2)}× for ${(large.inputBytes / small.inputBytes).toFixed(0)}× the input;` +
      ` above the empty input's ${(empty.maxRssBytes / MB).toFixed(0)} MB: ${((large.maxRssBytes - empty.maxRssBytes) / MB).toFixed(0)} vs ${((small.maxRssBytes - empty.maxRssBytes) / MB).toFixed(0)} MB`,
  );
  return rows;
}
