/** `treepack loss` and the advantages `treepack pack` writes, end to end through the compiled bin. */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { microBatchPaths } from '../src/io/manifest.js';
import { readMicroBatch, writeMicroBatch } from '../src/io/microbatch.js';
import { readSafetensors, writeSafetensors } from '../src/io/safetensors.js';
import { resolveLossConfig } from '../src/loss/config.js';
import { lossReference } from '../src/loss/reference.js';
import { generateTokenSamples } from '../bench/dataset.js';
import { randomLossCase, unpackedLoss } from './helpers/loss.js';
import { randomBatch } from './helpers/sequences.js';
import { cli } from './helpers/cli.js';

const dir = mkdtempSync(join(tmpdir(), 'treepack-loss-cli-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

describe('treepack loss', () => {
  const { batch, lp, unpacked } = randomLossCase(randomBatch(3, { count: 25 }), 3);
  const mb = join(dir, 'mb.safetensors');
  const lpFile = join(dir, 'lp.safetensors');
  const cfgFile = join(dir, 'loss.json');
  writeMicroBatch(mb, batch);
  writeSafetensors(lpFile, new Map([['logprobs', { dtype: 'F32', shape: [lp.length], data: lp }]]));
  const config = { clip_low: 0.2, clip_high: 0.28, dual_clip: 3, aggregation: 'seq-mean-token-mean', kl: 'k3', kl_coef: 0.1 };
  writeFileSync(cfgFile, JSON.stringify(config));

  it('prints loss and metrics equal to the unpacked reference, and writes the gradient', () => {
    const gradFile = join(dir, 'grad.safetensors');
    const r = cli(['loss', mb, '--logprobs', lpFile, '--config', cfgFile, '--json', '--grad-out', gradFile, '--backend', 'cpu']);
    expect(r.code, r.stderr).toBe(0);
    const out = JSON.parse(r.stdout);
    const want = unpackedLoss(unpacked, resolveLossConfig(config));
    expect(Math.abs(out.loss - want.loss)).toBeLessThan(1e-6);
    expect(out.metrics.trainable_tokens).toBe(want.trainable_tokens);
    const grad = readSafetensors(gradFile).tensors.get('grad')!.data as Float32Array;
    const js = lossReference(batch, lp, resolveLossConfig(config)).grad;
    grad.forEach((g, p) => expect(Math.abs(g - js[p])).toBeLessThan(1e-6));
  });

  it('bad input: wrong logprobs length, unknown loss name; exit codes and named fields', () => {
    const short = join(dir, 'short.safetensors');
    writeSafetensors(short, new Map([['logprobs', { dtype: 'F32', shape: [3], data: lp.slice(0, 3) }]]));
    const r1 = cli(['loss', mb, '--logprobs', short]);
    expect(r1.code).toBe(1); // a bad input file, not bad usage
    expect(r1.stderr).toMatch(/short\.safetensors, field "logprobs": logprobs has 3 elements but the micro-batch has N = \d+ nodes/);
    const bad = join(dir, 'bad.json');
    writeFileSync(bad, JSON.stringify({ policy: 'ppo2' }));
    const r2 = cli(['loss', mb, '--logprobs', lpFile, '--config', bad]);
    expect(r2.code).toBe(1);
    expect(r2.stderr).toMatch(/bad\.json, field "policy": Expected one of ppo, gspo, cispo for policy but received "ppo2"/);
    expect(cli(['loss', mb]).code).toBe(2);
  });
});

describe('treepack pack writes advantages', () => {
  it('GRPO per group (task), one value per episode on every turn; --advantages none writes none', () => {
    const samples = [...generateTokenSamples({ groups: 2, seed: 9, minTurns: 2, maxTurns: 3 })];
    const input = join(dir, 'rollouts.jsonl');
    writeFileSync(input, samples.map((s) => JSON.stringify(s)).join('\n') + '\n');
    const out = join(dir, 'packed');
    expect(cli(['pack', input, '--out', out, '--quiet']).code).toBe(0);
    const { batch } = readMicroBatch(microBatchPaths(out)[0]);
    expect(batch.advantages).toBeDefined();
    // Expected: per group, (r − mean)/(std + 1e-6) over its episodes, with the unbiased std.
    const episodes = new Map<string, { group: string; reward: number }>();
    for (const s of samples) episodes.set(s.episode, { group: s.group, reward: s.reward });
    const byGroup = new Map<string, number[]>();
    for (const e of episodes.values()) byGroup.set(e.group, [...(byGroup.get(e.group) ?? []), e.reward]);
    samples.forEach((s, i) => {
      const rs = byGroup.get(s.group)!;
      const mean = rs.reduce((a, b) => a + b, 0) / rs.length;
      const std = Math.sqrt(rs.reduce((a, b) => a + (b - mean) ** 2, 0) / (rs.length - 1));
      const want = Math.fround((s.reward - mean) / (std + 1e-6));
      const a = batch.seq_offsets[i];
      expect(
        batch.advantages!.subarray(a, batch.seq_offsets[i + 1]).every((x) => x === want),
        `sample ${i}`,
      ).toBe(true);
    });
    const none = join(dir, 'packed-none');
    expect(cli(['pack', input, '--out', none, '--quiet', '--advantages', 'none']).code).toBe(0);
    expect(readMicroBatch(microBatchPaths(none)[0]).batch.advantages).toBeUndefined();
    expect(cli(['pack', input, '--out', none, '--advantages', 'ppo']).code).toBe(2);
  });
});
