/**
 * The one way generated files are written (`npm run gen:abi`, `npm run gen:docs`): each rendered from its source of
 * truth; with --check nothing is written and the exit code is 1 when a file on disk differs.
 */
import { readFileSync, writeFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

/** A generated file: its path from the repository root and how to render it. */
export interface Generated {
  path: string;
  render: () => string;
}

const root = fileURLToPath(new URL('..', import.meta.url));

/** Writes (or with `--check` in argv, checks) every file of `files`; `command` is what regenerates them. */
export function writeGenerated(files: readonly Generated[], command: string): void {
  const check = process.argv.includes('--check');
  let stale = 0;
  for (const g of files) {
    const text = g.render();
    let current = '';
    try {
      current = readFileSync(root + g.path, 'utf8');
    } catch {
      // not written yet
    }
    if (current === text) continue;
    if (check) {
      console.error(`${g.path} is stale: run ${command}`);
      stale++;
    } else {
      writeFileSync(root + g.path, text);
      console.log(`wrote ${g.path}`);
    }
  }
  process.exitCode = stale ? 1 : 0;
}
