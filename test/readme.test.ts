/** The README's library example runs as written (through the package's own `treepack` export). */
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { expect, it } from 'vitest';
import { readMicroBatch } from '../src/io/microbatch.js';
import { generateJsonl } from '../src/records/generator.js';

const root = resolve(__dirname, '..');

it('README library example', () => {
  const readme = readFileSync(join(root, 'README.md'), 'utf8');
  const code = /```ts\n([\s\S]*?)```/.exec(readme)![1];
  const dir = mkdtempSync(join(tmpdir(), 'treepack-readme-'));
  // The example must live inside the package for `import … from 'treepack'` to resolve to this checkout.
  const script = join(root, `.readme-example-${process.pid}.mts`);
  try {
    writeFileSync(join(dir, 'rollouts.jsonl'), generateJsonl({ groups: 1, episodesPerGroup: 2, minTurns: 2, maxTurns: 3 }));
    writeFileSync(script, code.replaceAll("'rollouts.jsonl'", JSON.stringify(join(dir, 'rollouts.jsonl'))).replaceAll("'out/", `'${dir}/`));
    const r = spawnSync(process.execPath, ['--import', 'tsx', script], { cwd: root, encoding: 'utf8' });
    expect(r.status, r.stderr).toBe(0);
    expect(r.stdout).toMatch(/packForest on (cpu|js)/);
    const { batch } = readMicroBatch(join(dir, 'microbatch-00000.safetensors'));
    expect(r.stdout).toContain(`${batch.meta.num_tokens_naive} → ${batch.meta.num_tokens_packed}`);
  } finally {
    rmSync(script, { force: true });
    rmSync(dir, { recursive: true, force: true });
  }
});
