/**
 * `treepack doctor` and `treepack pack --masks` end to end, through the compiled bin: the mask tensors in each
 * micro-batch file equal the js reference recomputed from the file's own tree arrays.
 */
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { microBatchPaths } from '../src/io/manifest.js';
import { readMicroBatch } from '../src/io/microbatch.js';
import { maskBlocks } from '../src/mask/blocks.js';
import { maskSlices } from '../src/mask/slices.js';
import { generateTokenSamples } from '../bench/dataset.js';
import { cli } from './helpers/cli.js';

const dir = mkdtempSync(join(tmpdir(), 'treepack-cli-masks-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const tokenFile = join(dir, 'tokens.jsonl');
writeFileSync(
  tokenFile,
  [...generateTokenSamples({ groups: 2, seed: 3, minTurns: 3, maxTurns: 5 })].map((s) => JSON.stringify(s)).join('\n') + '\n',
);

describe('treepack doctor', () => {
  it('reports every backend, available or not, with a reason', () => {
    const r = cli(['doctor', '--json']);
    expect(r.code, r.stderr).toBe(0);
    const report = JSON.parse(r.stdout);
    expect(report.backends.map((b: { name: string }) => b.name)).toEqual(['cuda', 'webgpu', 'cpu', 'js']);
    for (const b of report.backends) expect(typeof b.detail === 'string' && b.detail.length > 0).toBe(true);
    expect(report.backends.find((b: { name: string }) => b.name === 'js')).toMatchObject({
      available: true,
      ops: expect.arrayContaining(['maskBlocks', 'maskSlices']),
    });
    const text = cli(['doctor']);
    expect(text.code).toBe(0);
    expect(text.stdout).toMatch(/cuda +(available|unavailable)/);
    expect(cli(['doctor', '--help']).stdout).toMatch(/Usage: treepack doctor/);
  });
});

describe('treepack pack --masks', () => {
  for (const backend of ['cpu', 'auto']) {
    it(`adds the block mask and slices to every micro-batch (mask backend ${backend})`, () => {
      const out = join(dir, `packed-${backend}`);
      const r = cli([
        'pack',
        tokenFile,
        '--out',
        out,
        '--max-naive-tokens',
        '20000',
        '--masks',
        'block:64,slices',
        '--mask-backend',
        backend,
      ]);
      expect(r.code, r.stderr).toBe(0);
      const manifest = JSON.parse(readFileSync(join(out, 'manifest.json'), 'utf8'));
      expect(manifest.masks).toEqual(['block:64', 'slices']);
      expect(manifest.micro_batches.length).toBeGreaterThan(1);
      for (const m of manifest.micro_batches) {
        const { batch, extra, extraMeta } = readMicroBatch(join(out, m.file));
        expect(extraMeta).toEqual({ block_size: '64' });
        const ref = maskBlocks(batch, 64);
        const nb = ref.num_blocks;
        for (const name of ['block_kv_num_blocks', 'block_full_kv_num_blocks'] as const)
          expect(extra.get(name)).toEqual({ dtype: 'I32', shape: [nb], data: ref[name] });
        for (const name of ['block_kv_indices', 'block_full_kv_indices'] as const)
          expect(extra.get(name)).toEqual({ dtype: 'I32', shape: [nb, nb], data: ref[name] });
        const slices = maskSlices(batch);
        expect(extra.get('slices')).toEqual({ dtype: 'I32', shape: [slices.length / 5, 5], data: slices });
      }
    });
  }

  it('cu_seqlens on a forest with sharing stops with the micro-batch named and writes nothing', () => {
    const out = join(dir, 'shared');
    const r = cli(['pack', tokenFile, '--out', out, '--masks', 'cu_seqlens']);
    expect(r.code).toBe(1);
    expect(r.stderr).toMatch(
      /microbatch-00000\.safetensors: field "parent": cu_seqlens needs a forest with no sharing, but node \d+ has more than one child/,
    );
    expect(existsSync(out) ? readdirSync(out) : []).toEqual([]);
  });

  it('cu_seqlens on a forest without sharing', () => {
    const file = join(dir, 'chains.jsonl');
    writeFileSync(file, ['{"tokens":[1,2,3]}', '{"tokens":[4,5]}', '{"tokens":[1,2,3]}'].join('\n') + '\n');
    const out = join(dir, 'chains');
    const r = cli(['pack', file, '--out', out, '--masks', 'cu_seqlens']);
    expect(r.code, r.stderr).toBe(0);
    const { extra } = readMicroBatch(microBatchPaths(out)[0]);
    expect(Array.from(extra.get('cu_seqlens')!.data as Int32Array)).toEqual([0, 3, 5]);
  });

  it('rejects a bad --masks or --mask-backend with usage', () => {
    for (const args of [
      ['--masks', 'block:0'],
      ['--masks', 'flash'],
      ['--mask-backend', 'tpu'],
    ]) {
      const r = cli(['pack', tokenFile, '--out', join(dir, 'bad'), ...args]);
      expect(r.code, args.join(' ')).toBe(2);
      expect(r.stderr).toMatch(/--mask/);
    }
  });
});

describe('micro-batch extra metadata', () => {
  it('round-trips keys outside the contract and refuses contract keys', async () => {
    const { packForest } = await import('../src/pack/forest.js');
    const { writeMicroBatch } = await import('../src/io/microbatch.js');
    const forest = packForest({ tokens: Int32Array.from([1, 2, 1, 3]), offsets: Int32Array.from([0, 2, 4]) });
    const batch = {
      ...forest,
      loss_mask: Uint8Array.from([0, 1, 0, 1]),
      meta: {
        format: 'treepack/1' as const,
        num_sequences: 2,
        num_tokens_naive: 4,
        num_tokens_packed: 3,
        tokenizer: 't',
        sequence_ids: ['a', 'b'],
      },
    };
    const file = join(dir, 'meta.safetensors');
    writeMicroBatch(file, batch, new Map(), { block_size: '128' });
    expect(readMicroBatch(file).extraMeta).toEqual({ block_size: '128' });
    expect(() => writeMicroBatch(join(dir, 'bad.safetensors'), batch, new Map(), { num_sequences: '9' })).toThrow(
      /a key outside the micro-batch contract/,
    );
    expect(existsSync(join(dir, 'bad.safetensors'))).toBe(false);
  });
});
