/** The README's library examples run as written (through the package's own `treepack` export). */
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { basename, join, resolve } from 'node:path';
import { afterAll, expect, it } from 'vitest';
import { readMicroBatch } from '../src/io/microbatch.js';
import { checkForest } from '../src/pack/invariants.js';
import { generateJsonl } from '../bench/dataset.js';
import { cli } from './helpers/cli.js';

const root = resolve(__dirname, '..');
const readme = readFileSync(join(root, 'README.md'), 'utf8');
const library = readme.slice(readme.indexOf('## Library\n'), readme.indexOf('\n## ', readme.indexOf('## Library\n') + 1));
const examples = [...library.matchAll(/```ts\n([\s\S]*?)```/g)].map((m) => m[1]);
const dir = mkdtempSync(join(tmpdir(), 'treepack-readme-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
const input = join(dir, 'rollouts.jsonl');
writeFileSync(input, generateJsonl({ groups: 2, episodesPerGroup: 2, minTurns: 2, maxTurns: 4 }));

/** Runs one example with its paths pointed into `dir`; returns stdout. */
function runExample(code: string): string {
  // The example must live inside the package for `import … from 'treepack'` to resolve to this checkout.
  const script = join(root, `.readme-example-${process.pid}.mts`);
  try {
    writeFileSync(script, code.replaceAll("'rollouts.jsonl'", JSON.stringify(input)).replaceAll("'out/", `'${dir}/`));
    const r = spawnSync(process.execPath, ['--import', 'tsx', script], { cwd: root, encoding: 'utf8' });
    expect(r.status, r.stderr).toBe(0);
    return r.stdout;
  } finally {
    rmSync(script, { force: true });
  }
}

it('the Library section has its two examples', () => {
  expect(examples.length).toBe(2);
});

it('README library example: the whole pipeline into a directory', () => {
  const stdout = runExample(examples[0]);
  expect(stdout).toMatch(/packForest on (cpu|js)/);
  const out = join(dir, 'packed');
  const manifest = JSON.parse(readFileSync(join(out, 'manifest.json'), 'utf8'));
  expect(stdout).toContain(`${manifest.naive_tokens} → ${manifest.packed_tokens} tokens in ${manifest.micro_batches.length} micro-batches`);
  expect(manifest).toMatchObject({ max_tokens: 32768, dp: 8, pad_multiple: 128, masks: ['block:128'] });
  expect(manifest.micro_batches.length % 8).toBe(0);
  for (const m of manifest.micro_batches) {
    const { batch, extra, extraMeta } = readMicroBatch(join(out, m.file));
    expect(checkForest(batch)).toEqual([]);
    expect(batch.input_ids.length % 128).toBe(0);
    expect(extra.has('block_kv_indices')).toBe(true);
    expect(extraMeta.block_size).toBe('128');
  }
}, 120_000);

it('README library example: records pushed one at a time give the CLI files', () => {
  const lines = runExample(examples[1]).trim().split('\n');
  const out = join(dir, 'cli');
  const r = cli(['pack', input, '--out', out, '--max-naive-tokens', '100000', '--tokenizer', 'qwen3', '--quiet']);
  expect(r.code, r.stderr).toBe(0);
  const manifest = JSON.parse(readFileSync(join(out, 'manifest.json'), 'utf8'));
  // The packer names files; the CLI's manifest puts them in a generation directory (README, "Output directory").
  expect(lines).toEqual(manifest.micro_batches.map((m: { file: string }) => `${basename(m.file)} ${readFileSync(join(out, m.file)).length}`));
}, 120_000);
