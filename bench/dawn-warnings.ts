/**
 * Dawn (the WebGPU backend's native library) prints the same adapter warnings to stderr every time an adapter is
 * requested, from C++ where Node cannot intercept them. The bench therefore runs itself as a child with stderr
 * piped: Dawn's warnings (a "Warning: …" line and its "    at …" source lines) are counted and reported once at
 * the end; every other stderr line passes through as it comes.
 */
import { spawn } from 'node:child_process';
import { createInterface } from 'node:readline';

const CHILD = 'TREEPACK_BENCH_CHILD';

/** In the parent: runs this script again as the child, filters its stderr, exits with its status. */
export async function superviseDawnWarnings(): Promise<void> {
  if (process.env[CHILD] === '1') return;
  const child = spawn(process.execPath, [...process.execArgv, ...process.argv.slice(1)], {
    env: { ...process.env, [CHILD]: '1' },
    stdio: ['inherit', 'inherit', 'pipe'],
  });
  const counts = new Map<string, number>();
  let current: string | null = null;
  const flush = () => {
    if (current !== null) counts.set(current, (counts.get(current) ?? 0) + 1);
    current = null;
  };
  for await (const line of createInterface({ input: child.stderr })) {
    if (line.startsWith('Warning: ')) {
      flush();
      current = line.slice('Warning: '.length);
    } else if (current !== null && (line.startsWith('    at ') || line.trim() === '')) {
      continue; // the warning's source location and the blank line after it
    } else {
      flush();
      process.stderr.write(line + '\n');
    }
  }
  flush();
  const code: number = await new Promise((res) =>
    child.exitCode !== null ? res(child.exitCode) : child.on('exit', (c, s) => res(c ?? (s ? 1 : 0))),
  );
  if (counts.size) {
    const total = [...counts.values()].reduce((a, x) => a + x, 0);
    console.log(`\nDawn (WebGPU) printed ${total} warnings, ${counts.size} distinct (each reported once):`);
    for (const [w, n] of counts) console.log(`  ${w}${n > 1 ? `  (×${n})` : ''}`);
  }
  process.exit(code);
}
