/**
 * What a hostile but realistic input must not get through (issue 12): finite JSON numbers that overflow the float32
 * the micro-batch stores, rewards that overflow an estimator, one episode_id on two different episodes, invalid
 * UTF-8, loss masks other than 0/1 and negative ids at the loss; and the CLI's one exit-code table.
 */
import { isUtf8 } from 'node:buffer';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Readable } from 'node:stream';
import { afterAll, describe, expect, it } from 'vitest';
import { EXIT_FAILURE, EXIT_OK, EXIT_USAGE, TreepackError } from '../src/errors.js';
import { microBatchPaths } from '../src/io/manifest.js';
import { readMicroBatch, writeMicroBatch } from '../src/io/microbatch.js';
import { writeSafetensors } from '../src/io/safetensors.js';
import { episodeAdvantages, sampleAdvantages } from '../src/loss/advantages.js';
import { computeLoss } from '../src/backend/index.js';
import { generateEpisodes } from '../bench/dataset.js';
import { firstInvalidUtf8 } from '../src/records/jsonl.js';
import { readRecords, type ReadOptions } from '../src/records/read.js';
import type { TrainRecord } from '../src/records/types.js';
import { cli } from './helpers/cli.js';
import { randomLossCase } from './helpers/loss.js';
import { randomBatch, rng } from './helpers/sequences.js';

const dir = mkdtempSync(join(tmpdir(), 'treepack-reliability-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

async function read(lines: (string | Buffer)[], opts: ReadOptions = {}): Promise<TrainRecord[]> {
  const bytes = Buffer.concat(lines.flatMap((l) => [Buffer.from(l), Buffer.from('\n')]));
  const out: TrainRecord[] = [];
  for await (const r of readRecords(Readable.from([bytes]), { name: 't.jsonl', ...opts })) out.push(r);
  return out;
}

async function rejection(p: Promise<unknown>): Promise<TreepackError> {
  const err = await p.then(
    () => undefined,
    (e: unknown) => e,
  );
  expect(err).toBeInstanceOf(TreepackError);
  return err as TreepackError;
}

const sample = (extra: object) => JSON.stringify({ id: 's', tokens: [1, 2, 3, 4], ...extra });

describe('float fields are finite after conversion to float32', () => {
  it('rejects finite JSON numbers past float32, naming line, record and field', async () => {
    const cases: [string, string][] = [
      [sample({ advantage: 1e39 }), 'advantage'],
      [sample({ advantages: [0, 1, 1e39, 0] }), 'advantages[2]'],
      [sample({ old_logprobs: [0, -1, -1e39, -1] }), 'old_logprobs[2]'],
      [sample({ rollout_logprobs: [0, -1, -1, -3.5e38] }), 'rollout_logprobs[3]'],
      [JSON.stringify({ tokens: [1, 2, 3], response_length: 2, rollout_log_probs: [-1, -1e39], index: 4 }), 'rollout_log_probs[1]'],
      [
        JSON.stringify({
          messages: [{ role: 'user', content: 'hi' }],
          response: { content: 'yo', token_ids: [9, 10], logprobs: [-1, -1e39] },
        }),
        'response.logprobs[1]',
      ],
    ];
    for (const [line, field] of cases) {
      const err = await rejection(read([sample({ id: 'ok' }), line]));
      expect(err.where, line).toMatchObject({ file: 't.jsonl', line: 2, field });
      expect(err.message).toMatch(/outside the float32 range/);
    }
    // the largest float32 and values that round to it are fine
    const [rec] = await read([sample({ advantage: 3.4028235e38, old_logprobs: [0, -3.4028235e38, -1, -1] })]);
    expect(rec.kind === 'sample' && rec.old_logprobs![1]).toBe(-3.4028234663852886e38);
  });
});

describe('advantages never produce non-finite values', () => {
  /** The textbook formulas, in the order the estimator evaluates them, on rewards of ordinary size. */
  function naive(rewards: number[], estimator: string): number[] {
    const n = rewards.length;
    const mean = rewards.reduce((a, b) => a + b, 0) / n;
    const std = Math.sqrt(rewards.reduce((a, r) => a + (r - mean) ** 2, 0) / (n - 1));
    return rewards.map((r) =>
      estimator === 'grpo' ? (r - mean) / (std + 1e-6) : estimator === 'dr-grpo' ? r - mean : ((r - mean) * n) / (n - 1),
    );
  }

  it('is bit-identical to the plain formulas on ordinary rewards (scaling by powers of two is exact)', () => {
    const r = rng(12);
    for (let k = 0; k < 200; k++) {
      const n = 2 + Math.floor(r() * 8);
      const scale = 10 ** Math.floor(r() * 12 - 6);
      const rewards = Array.from({ length: n }, () => (r() - 0.3) * scale);
      for (const est of ['grpo', 'dr-grpo', 'rloo'] as const) {
        const got = episodeAdvantages(
          rewards,
          rewards.map(() => 'g'),
          { estimator: est },
        );
        naive(rewards, est).forEach((want, e) =>
          expect(Object.is(got[e], want), `${est} ${rewards.join(',')} ${e}: ${got[e]} vs ${want}`).toBe(true),
        );
      }
    }
  });

  it('rewards near the float64 limit: GRPO and the REINFORCE++ baseline are computed stably, as for small rewards', () => {
    const huge = [1e308, -1e308, 1e308, 0, -1.7e308];
    const small = huge.map((x) => x / 1e300);
    for (const est of ['grpo', 'reinforce++-baseline'] as const) {
      const a = episodeAdvantages(
        huge,
        huge.map(() => 'g'),
        { estimator: est },
      );
      const b = episodeAdvantages(
        small,
        small.map(() => 'g'),
        { estimator: est },
      );
      a.forEach((x, e) => {
        expect(Number.isFinite(Math.fround(x)), `${est} ${e}`).toBe(true);
        expect(Math.abs(x - b[e]), `${est} ${e}`).toBeLessThan(1e-9);
      });
    }
  });

  it('an advantage outside float32 (Dr.GRPO, RLOO on rewards near 1e39) is an error naming the group, line and record', () => {
    const turns = [
      { id: 'e1/0', group: 'task-7', episode: 'e1', reward: 1e39, loss_mask: new Uint8Array([0, 1]), source: { file: 'r.jsonl', line: 3 } },
      {
        id: 'e2/0',
        group: 'task-7',
        episode: 'e2',
        reward: -1e39,
        loss_mask: new Uint8Array([0, 1]),
        source: { file: 'r.jsonl', line: 4 },
      },
    ];
    for (const estimator of ['dr-grpo', 'rloo'] as const) {
      let err: unknown;
      try {
        sampleAdvantages(turns, { estimator });
      } catch (e) {
        err = e;
      }
      expect(err).toBeInstanceOf(TreepackError);
      expect((err as TreepackError).where).toMatchObject({ file: 'r.jsonl', line: 3, record: 'e1/0', field: 'reward' });
      expect((err as TreepackError).message).toMatch(/group "task-7" .* outside the float32 range/);
    }
    // GRPO of the same group is ±0.7071…: fine
    expect(Array.from(sampleAdvantages(turns, { estimator: 'grpo' })).map((x) => x.toFixed(4))).toEqual(['0.7071', '-0.7071']);
  });
});

/** Four episodes of one task (rewards 1, 1, 1, −1: GRPO 0.5 and −1.5); the second and third are written with one id. */
function episodes(): string[] {
  const eps = [...generateEpisodes({ groups: 1, episodesPerGroup: 4, seed: 8, minTurns: 2, maxTurns: 2, truncateEvery: 0 })];
  eps.forEach((e, k) => (e.meta.reward = [1, 1, 1, -1][k]));
  eps[2].episode_id = eps[1].episode_id;
  return eps.map((e) => JSON.stringify(e));
}

describe('episode ids are unambiguous', () => {
  it('one episode_id on two different episode lines is an error naming both lines', async () => {
    const lines = episodes();
    const err = await rejection(read(lines));
    expect(err.where).toMatchObject({ file: 't.jsonl', line: 3, field: 'episode_id', record: JSON.parse(lines[1]).episode_id });
    expect(err.message).toMatch(/already used by a different episode on line 2/);
    // a byte-identical repeat is the same episode; the option makes lines sharing an id parts of one episode
    expect((await read([lines[0], lines[0]])).length).toBe(4);
    expect((await read(lines, { repeatedEpisodeIds: true })).length).toBe(8);
  });

  it('through pack: exit 1 without the option; with it, GRPO sees 3 episodes as the user asked', { timeout: 180_000 }, () => {
    const input = join(dir, 'dup.jsonl');
    writeFileSync(input, episodes().join('\n') + '\n');
    const r = cli(['pack', input, '--out', join(dir, 'dup-out'), '--quiet', '--tokenizer', 'qwen3']);
    expect(r.code).toBe(EXIT_FAILURE);
    expect(r.stderr.trim().split('\n')).toHaveLength(1);
    expect(r.stderr).toContain(`${input}:3`);
    const ok = cli(['pack', input, '--out', join(dir, 'dup-out'), '--quiet', '--repeated-episode-ids', '--tokenizer', 'qwen3']);
    expect(ok.code, ok.stderr).toBe(EXIT_OK);
    const { batch } = readMicroBatch(microBatchPaths(join(dir, 'dup-out'))[0]);
    const adv = [...new Set(batch.advantages!.filter((_, k) => batch.loss_mask[k]))].map((x) => x.toFixed(3)).sort();
    expect(adv).toEqual(['-1.155', '0.577']); // GRPO over rewards 1, 1, −1 (4 episodes would give 0.5 and −1.5)
  });
});

describe('invalid UTF-8', () => {
  it('is an error naming the line and byte offset, or U+FFFD with lossyUtf8', async () => {
    const bad = Buffer.concat([Buffer.from('{"tokens": [1, 2], "group": "t'), Buffer.from([0xe9]), Buffer.from('st"}')]);
    const err = await rejection(read([sample({}), bad]));
    expect(err.where).toMatchObject({ file: 't.jsonl', line: 2 });
    const lineStart = Buffer.byteLength(sample({})) + 1;
    expect(err.message).toContain(`invalid UTF-8 at byte 30 of the line (byte ${lineStart + 30} of the input)`);
    const [, rec] = await read([sample({}), bad], { lossyUtf8: true });
    expect(rec.group).toBe('t\ufffdst');
  });

  it('firstInvalidUtf8 finds the first malformed sequence (agrees with isUtf8 on random bytes)', () => {
    const r = rng(3);
    const pieces = [
      [0x41],
      [0xc3, 0xa9],
      [0xe2, 0x82, 0xac],
      [0xf0, 0x9f, 0x98, 0x80],
      [0xff],
      [0xc0, 0x80],
      [0xed, 0xa0, 0x80],
      [0xf4, 0x90, 0x80, 0x80],
      [0x80],
      [0xe2, 0x82],
    ];
    for (let k = 0; k < 2000; k++) {
      const b = Buffer.from(Array.from({ length: Math.floor(r() * 6) }, () => pieces[Math.floor(r() * pieces.length)]).flat());
      const at = firstInvalidUtf8(b);
      expect(isUtf8(b.subarray(0, at))).toBe(true);
      expect(at === b.length).toBe(isUtf8(b));
      for (let j = at + 1; j <= Math.min(b.length, at + 4); j++)
        expect(isUtf8(b.subarray(0, j)), `${b.toString('hex')} at ${at}, prefix ${j}`).toBe(false);
    }
  });
});

describe('the loss refuses what a trainer would misread', () => {
  it(
    'loss_mask other than 0/1 and negative input_ids are E_INPUT naming the field, in the library and in treepack loss',
    { timeout: 120_000 },
    async () => {
      const { batch, lp } = randomLossCase(randomBatch(4, { count: 10 }), 4);
      const j = batch.loss_mask.findIndex((m) => m === 1);
      const seven = { ...batch, loss_mask: batch.loss_mask.slice() };
      seven.loss_mask[j] = 7;
      expect((await rejection(computeLoss(seven, lp))).where.field).toBe('loss_mask');
      const negative = { ...batch, input_ids: batch.input_ids.slice() };
      negative.input_ids[1] = -1;
      const err = await rejection(computeLoss(negative, lp));
      expect(err.where.field).toBe('input_ids');
      expect(err.message).toMatch(/input_ids\[1\] = -1/);

      const mb = join(dir, 'seven.safetensors');
      writeMicroBatch(mb, {
        ...seven,
        meta: {
          format: 'treepack/1',
          num_sequences: seven.seq_offsets.length - 1,
          num_tokens_naive: seven.seq_positions.length,
          num_tokens_packed: seven.input_ids.length,
          tokenizer: 't',
          sequence_ids: Array.from({ length: seven.seq_offsets.length - 1 }, (_, i) => String(i)),
        },
      } as never);
      const lpFile = join(dir, 'lp.safetensors');
      writeSafetensors(lpFile, new Map([['logprobs', { dtype: 'F32', shape: [lp.length], data: lp }]]));
      const r = cli(['loss', mb, '--logprobs', lpFile, '--backend', 'js']);
      expect(r.code).toBe(EXIT_FAILURE);
      expect(r.stderr).toMatch(/seven\.safetensors, field "loss_mask": loss_mask\[\d+\] = 7/);
    },
  );
});

describe('one exit-code table', () => {
  it('0 ok, 2 for a wrong command line (every command), 1 for bad input files', { timeout: 180_000 }, () => {
    const input = join(dir, 'one.jsonl');
    writeFileSync(input, sample({ advantage: 1e39 }) + '\n');
    for (const args of [
      ['pack', input, '--frob'],
      ['stats', input, '--vocab-size', 'x'],
      ['loss', 'x.safetensors'],
      ['doctor', '--frob'],
      ['serve', '--data', 'd'],
      ['frob'],
      [],
    ]) {
      expect(cli(args).code, args.join(' ')).toBe(EXIT_USAGE);
    }
    const r = cli(['pack', input, '--out', join(dir, 'never')]);
    expect(r.code).toBe(EXIT_FAILURE);
    expect(r.stderr).toBe(
      `treepack pack: ${input}:1, record "s", field "advantage": 1e+39 is outside the float32 range (±3.4028234663852886e+38) the micro-batch stores it in\n`,
    );
    expect(cli(['loss', join(dir, 'missing.safetensors'), '--logprobs', join(dir, 'missing.safetensors')]).code).toBe(EXIT_FAILURE);
    expect(cli(['help', 'pack']).code).toBe(EXIT_OK);
    expect(readFileSync(input, 'utf8')).toContain('1e+39');
  });
});
