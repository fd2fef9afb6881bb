/**
 * The `treepack` command end to end, as a user runs it: the compiled bin (built by `npm test`'s pretest step),
 * real files, exit codes. Output is checked by reading it back and re-deriving every sequence.
 */
import { execFileSync } from 'node:child_process';
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { microBatchPaths } from '../src/io/manifest.js';
import { readMicroBatch } from '../src/io/microbatch.js';
import { checkForest } from '../src/pack/invariants.js';
import { generateJsonl, generateTokenSamples } from '../bench/dataset.js';
import { BIN, cli } from './helpers/cli.js';

const dir = mkdtempSync(join(tmpdir(), 'treepack-cli-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const tokenLines = [...generateTokenSamples({ groups: 3, seed: 5, minTurns: 3, maxTurns: 6 })].map((s) => JSON.stringify(s));
const tokenFile = join(dir, 'tokens.jsonl');
writeFileSync(tokenFile, tokenLines.join('\n') + '\n');

describe('treepack CLI', () => {
  it('prints help for the tool and for every command', () => {
    expect(cli(['--help']).stdout).toMatch(/Commands:/);
    for (const cmd of ['pack', 'stats']) {
      const r = cli([cmd, '--help']);
      expect(r.code).toBe(0);
      expect(r.stdout).toMatch(new RegExp(`Usage: treepack ${cmd}`));
    }
    expect(cli(['frobnicate']).code).toBe(2);
  });

  it('pack writes micro-batches that read back to exactly the input sequences', () => {
    const out = join(dir, 'packed');
    const r = cli(['pack', tokenFile, '--out', out, '--max-naive-tokens', '20000']);
    expect(r.code, r.stderr).toBe(0);
    const manifest = JSON.parse(readFileSync(join(out, 'manifest.json'), 'utf8'));
    expect(manifest.micro_batches.length).toBeGreaterThan(1);
    const inputs = tokenLines.map((l) => JSON.parse(l) as { id: string; tokens: number[]; loss_mask: number[] });
    let k = 0;
    for (const m of manifest.micro_batches) {
      const { batch } = readMicroBatch(join(out, m.file));
      expect(checkForest(batch)).toEqual([]);
      expect(batch.meta.num_tokens_packed).toBe(m.packed_tokens);
      expect(batch.input_ids.length).toBeLessThan(batch.seq_positions.length);
      for (let i = 0; i < batch.meta.num_sequences; i++, k++) {
        const want = inputs[k];
        expect(batch.meta.sequence_ids[i]).toBe(want.id);
        const pos = batch.seq_positions.subarray(batch.seq_offsets[i], batch.seq_offsets[i + 1]);
        expect(Array.from(pos, (p) => batch.input_ids[p])).toEqual(want.tokens);
        const mask = Array.from(batch.loss_mask.subarray(batch.seq_offsets[i], batch.seq_offsets[i + 1]));
        expect(mask).toEqual([0, ...want.loss_mask.slice(1)]);
      }
    }
    expect(k).toBe(inputs.length);
    expect(readdirSync(out).filter((f) => f.startsWith('.'))).toEqual([]);
  });

  it('reads stdin and agrees with stats --json', () => {
    const out = join(dir, 'stdin');
    expect(cli(['pack', '-', '--out', out, '--quiet'], tokenLines.join('\n')).code).toBe(0);
    const manifest = JSON.parse(readFileSync(join(out, 'manifest.json'), 'utf8'));
    const r = cli(['stats', tokenFile, '--json']);
    expect(r.code, r.stderr).toBe(0);
    const s = JSON.parse(r.stdout);
    expect(s.records).toBe(tokenLines.length);
    expect(s.samples).toBe(tokenLines.length);
    expect(s.naive_tokens).toBe(manifest.naive_tokens); // token samples without message boundaries are not merged
    expect(s.merged_tokens).toBe(manifest.naive_tokens);
    expect(s.packed_tokens).toBe(manifest.packed_tokens);
    expect(s.compression).toBeCloseTo(s.naive_tokens / s.packed_tokens, 12);
    expect(s.groups.map((g: { group: string }) => g.group).sort()).toEqual(['task-0', 'task-1', 'task-2']);
    expect(s.branch_depth_histogram.reduce((a: number, b: { count: number }) => a + b.count, 0)).toBeGreaterThan(0);
  });

  it('packs chat episodes through the Qwen3 template on both backends with identical bytes', () => {
    const file = join(dir, 'chat.jsonl');
    writeFileSync(file, generateJsonl({ groups: 1, episodesPerGroup: 3, minTurns: 3, maxTurns: 5, seed: 2 }));
    const outs = ['cpu', 'js'].map((backend) => {
      const out = join(dir, `chat-${backend}`);
      const r = cli(['pack', file, '--out', out, '--backend', backend, '--tokenizer', 'qwen3']);
      expect(r.code, r.stderr).toBe(0);
      return readFileSync(microBatchPaths(out)[0]);
    });
    expect(outs[0].equals(outs[1])).toBe(true);
    // No default tokenizer: another model's token ids would train silently wrong.
    const none = cli(['pack', file, '--out', join(dir, 'chat-none')]);
    expect(none.code).toBe(1);
    expect(none.stderr).toMatch(
      /chat\.jsonl:1, record "[^"]+", field "tokenizer": chat records need a tokenizer, and none was given: pass a tokenizer directory .*--tokenizer DIR.* or a built-in by name \(qwen3/,
    );
    expect(existsSync(join(dir, 'chat-none'))).toBe(false);
    const { batch } = readMicroBatch(microBatchPaths(join(dir, 'chat-cpu'))[0]);
    expect(batch.meta.vocab_size).toBe(151_669);
    expect(batch.meta.tokenizer).toMatch(/Qwen3/);
    expect(batch.meta.num_tokens_packed).toBeLessThan(batch.meta.num_tokens_naive / 2);
  });

  it('bad input: exit 1, names file, line and field, leaves earlier output untouched', () => {
    const out = join(dir, 'keep');
    expect(cli(['pack', tokenFile, '--out', out, '--quiet']).code).toBe(0);
    const before = readFileSync(microBatchPaths(out)[0]);
    const manifestBefore = readFileSync(join(out, 'manifest.json'), 'utf8');
    const bad = join(dir, 'bad.jsonl');
    const broken = JSON.parse(tokenLines[2]);
    broken.loss_mask = broken.loss_mask.slice(1);
    writeFileSync(bad, [tokenLines[0], tokenLines[1], JSON.stringify(broken), tokenLines[3]].join('\n'));
    const r = cli(['pack', bad, '--out', out]);
    expect(r.code).toBe(1);
    expect(r.stderr).toContain(`${bad}:3`);
    expect(r.stderr).toContain('loss_mask');
    expect(readFileSync(microBatchPaths(out)[0]).equals(before)).toBe(true);
    expect(readFileSync(join(out, 'manifest.json'), 'utf8')).toBe(manifestBefore);
    expect(readdirSync(out).filter((f) => f.startsWith('.'))).toEqual([]);

    writeFileSync(bad, tokenLines[0] + '\n{"tokens": [1, 2,\n');
    const r2 = cli(['pack', bad, '--out', join(dir, 'never')]);
    expect(r2.code).toBe(1);
    expect(r2.stderr).toContain(`${bad}:2`);
    expect(existsSync(join(dir, 'never'))).toBe(false);
    expect(readdirSync(dir).filter((f) => f.startsWith('.'))).toEqual([]);
  });

  it('pack --max-tokens --dp --pad-multiple: budgeted micro-batches, ranks and costs in the manifest', () => {
    const out = join(dir, 'budget');
    const longest = Math.max(...tokenLines.map((l) => JSON.parse(l).tokens.length));
    const T = 4 * Math.ceil(longest / 128) * 128;
    const r = cli(['pack', tokenFile, '--out', out, '--max-tokens', String(T), '--dp', '2', '--pad-multiple', '128']);
    expect(r.code, r.stderr).toBe(0);
    expect(r.stderr).toMatch(/rank imbalance/);
    const m = JSON.parse(readFileSync(join(out, 'manifest.json'), 'utf8'));
    expect(m.micro_batches.length % 2).toBe(0);
    expect([m.max_tokens, m.dp, m.pad_multiple]).toEqual([T, 2, 128]);
    const ids: string[] = [];
    m.micro_batches.forEach(
      (e: { file: string; rank: number; step: number; packed_tokens: number; pad_tokens: number; cost: number }, k: number) => {
        const { batch } = readMicroBatch(join(out, e.file));
        expect(checkForest(batch)).toEqual([]);
        expect(batch.input_ids.length).toBe(e.packed_tokens);
        expect(e.packed_tokens).toBeLessThanOrEqual(T);
        expect(e.packed_tokens % 128).toBe(0);
        expect(batch.meta.num_pad_tokens).toBe(e.pad_tokens);
        expect([e.rank, e.step]).toEqual([k % 2, Math.floor(k / 2)]);
        expect(e.cost).toBeGreaterThan(0);
        ids.push(...batch.meta.sequence_ids);
      },
    );
    expect(ids.sort()).toEqual(tokenLines.map((l) => JSON.parse(l).id).sort());
    expect(m.packed_tokens).toBeGreaterThanOrEqual(m.optimum_tokens);
    expect(m.imbalance).toBeCloseTo((Math.max(...m.rank_costs) * 2) / (m.rank_costs[0] + m.rank_costs[1]), 12);

    const small = cli(['pack', tokenFile, '--out', join(dir, 'never2'), '--max-tokens', String(longest - 1)]);
    expect(small.code).toBe(1); // the data does not fit the budget: input, not usage
    expect(small.stderr).toContain(`use a budget of at least ${longest}`);
    expect(cli(['pack', tokenFile, '--out', join(dir, 'never2'), '--max-tokens', String(T), '--dp', '0']).stderr).toMatch(/--dp/);
    expect(cli(['pack', tokenFile, '--out', join(dir, 'never2'), '--dp', '2']).stderr).toMatch(/--dp needs --max-tokens/);
    expect(cli(['pack', tokenFile, '--out', join(dir, 'never2'), '--max-tokens', String(T), '--balance-slack', '-1']).stderr).toMatch(
      /--balance-slack/,
    );
    expect(existsSync(join(dir, 'never2'))).toBe(false);
  });

  it('bad options: exit 2 with the usage', () => {
    const r = cli(['pack', tokenFile]);
    expect(r.code).toBe(2);
    expect(r.stderr).toMatch(/--out DIR is required/);
    expect(cli(['stats', tokenFile, '--backend', 'tpu']).stderr).toMatch(/Expected one of auto, cuda, webgpu, cpu, js for --backend/);
    expect(cli(['stats', tokenFile, '--max-naive-tokens', '-3']).code).toBe(2);
  });

  it('version matches package.json', () => {
    const pkg = JSON.parse(readFileSync(resolve(__dirname, '../package.json'), 'utf8'));
    expect(execFileSync(process.execPath, [BIN, '--version'], { encoding: 'utf8' }).trim()).toBe(pkg.version);
  });
});

describe('treepack pack: inputs checked beyond their syntax', () => {
  const write = (name: string, lines: object[]) => {
    const f = join(dir, name);
    writeFileSync(f, lines.map((l) => JSON.stringify(l)).join('\n') + '\n');
    return f;
  };

  it('engine token ids of a chat response are checked against the vocabulary', () => {
    const f = write('engine.jsonl', [
      { messages: [{ role: 'user', content: 'hi' }], response: { role: 'assistant', content: 'ok', token_ids: [999_999_999, 5] } },
    ]);
    const r = cli(['pack', f, '--out', join(dir, 'engine'), '--tokenizer', 'qwen3']);
    expect(r.code).toBe(1);
    expect(r.stderr).toContain(`${f}:1`);
    expect(r.stderr).toMatch(/field "response\.token_ids\[0\]": token id 999999999 is outside the vocabulary \(size 151669\)/);
  });

  it('a group repeated after a cut is fine when nothing is estimated from rewards', () => {
    const f = write('groups.jsonl', [
      { id: 'a1', group: 'A', tokens: [1, 2, 3] },
      { id: 'b1', group: 'B', tokens: [1, 2, 4] },
      { id: 'a2', group: 'A', tokens: [1, 2, 5] },
    ]);
    expect(cli(['pack', f, '--out', join(dir, 'groups'), '--max-naive-tokens', '2', '--quiet']).code).toBe(0);
    const withRewards = write('groups-r.jsonl', [
      { id: 'a1', group: 'A', episode: 'a1', reward: 1, tokens: [1, 2, 3] },
      { id: 'b1', group: 'B', episode: 'b1', reward: 1, tokens: [1, 2, 4] },
      { id: 'a2', group: 'A', episode: 'a2', reward: 0, tokens: [1, 2, 5] },
    ]);
    const r = cli(['pack', withRewards, '--out', join(dir, 'groups-r'), '--max-naive-tokens', '2']);
    expect(r.code).toBe(1);
    expect(r.stderr).toMatch(/groups-r\.jsonl:3, record "a2", field "group": group "A" appears again/);
  });

  it('a group mixing given advantages with rewards to estimate is refused, naming file and line', () => {
    const f = write('mixed.jsonl', [
      { id: 'a1', group: 'A', episode: 'e1', reward: 1, tokens: [1, 2, 3] },
      { id: 'a2', group: 'A', episode: 'e2', reward: 0, advantage: -5, tokens: [1, 2, 4] },
      { id: 'a3', group: 'A', episode: 'e3', reward: 0, tokens: [1, 2, 5] },
    ]);
    const r = cli(['pack', f, '--out', join(dir, 'mixed')]);
    expect(r.code).toBe(1);
    expect(r.stderr).toMatch(/mixed\.jsonl:2, record "a2", field "advantage": group "A" mixes samples/);
    const episode = write('episode.jsonl', [
      { id: 'a1', group: 'A', episode: 'e1', reward: 1, tokens: [1, 2, 3] },
      { id: 'a2', group: 'A', episode: 'e1', reward: 0, tokens: [1, 2, 4] },
    ]);
    expect(cli(['pack', episode, '--out', join(dir, 'episode')]).stderr).toMatch(
      /episode\.jsonl:2, record "a2", field "reward": episode "e1" has turns with different rewards/,
    );
  });
});
