/**
 * The CLI is the library: `treepack pack` (the compiled bin) and `packRecords(...).writeTo(new DirectorySink(...))`
 * write the same files byte for byte, manifest included, on generated and real (tau-bench) data; `treepack stats --json`
 * reports the library's figures; and every input the CLI rejects, the library rejects with the same error.
 */
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { basename, join, relative, resolve } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { createPacker, DirectorySink, MemorySink, packRecords, readRecords, TreepackError, type PackerOptions } from '../src/index.js';
import { generateJsonl, generateTokenSamples } from '../bench/dataset.js';
import { cli } from './helpers/cli.js';

const dir = mkdtempSync(join(tmpdir(), 'treepack-packer-cli-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

// Real agent trajectories: the slice in the repository always (test/fixtures/README.md), the whole file where present.
const TAU_SLICE = resolve(__dirname, 'fixtures/tau-bench-airline-slice.jsonl');
const TAU_BENCH = resolve(__dirname, '../../shared/data/tau_bench_gpt4o_airline.jsonl');
const tauSkip = existsSync(TAU_BENCH) ? '' : `${TAU_BENCH} not found`;
if (tauSkip) console.log(`CLI vs library on the whole tau-bench file skipped (the slice still runs): ${tauSkip}`);

const episodes = join(dir, 'episodes.jsonl');
writeFileSync(episodes, generateJsonl({ groups: 3, episodesPerGroup: 4, minTurns: 3, maxTurns: 8, seed: 2 }));
const tokens = join(dir, 'tokens.jsonl');
writeFileSync(
  tokens,
  [...generateTokenSamples({ groups: 4, episodesPerGroup: 3, minTurns: 2, maxTurns: 5, seed: 9 })]
    .map((s) => JSON.stringify(s))
    .join('\n') + '\n',
);

/** Every file under `d` by its path relative to `d` (micro-batches live in the run's generation directory). */
function files(d: string): Map<string, Buffer> {
  return new Map(
    readdirSync(d, { recursive: true, withFileTypes: true })
      .filter((e) => e.isFile())
      .map((e) => relative(d, join(e.parentPath, e.name)))
      .sort()
      .map((f) => [f, readFileSync(join(d, f))]),
  );
}

/** A token trie: child by token id. */
type Trie = Map<number, Trie>;

let runs = 0;
/**
 * Packs `input` with the CLI and with the library, both with the built-in Qwen3 tokenizer named; both directories,
 * every file compared byte for byte.
 */
async function compare(input: string, flags: string[], options: PackerOptions): Promise<Map<string, Buffer>> {
  const args = ['--tokenizer', 'qwen3', ...flags];
  const opts: PackerOptions = { tokenizer: 'qwen3', ...options };
  const k = runs++;
  const viaCli = join(dir, `cli-${k}`);
  const viaLib = join(dir, `lib-${k}`);
  const r = cli(['pack', input, '--out', viaCli, '--quiet', ...args]);
  expect(r.code, r.stderr).toBe(0);
  const manifest = await packRecords(input, opts).writeTo(new DirectorySink(viaLib));
  const a = files(viaCli);
  const b = files(viaLib);
  expect([...b.keys()]).toEqual([...a.keys()]);
  for (const [name, bytes] of a) expect(b.get(name)!.equals(bytes), name).toBe(true);
  expect(manifest.micro_batches.length).toBe(a.size - 1);
  // In memory, the same bytes: what a service would send instead of writing. Its manifest differs only in naming
  // no generation directory.
  const mem = new MemorySink();
  const memManifest = await packRecords(input, opts).writeTo(mem);
  expect(mem.files.size).toBe(a.size);
  const onDisk = JSON.parse(a.get('manifest.json')!.toString());
  expect(memManifest.micro_batches.map((e) => e.file)).toEqual(onDisk.micro_batches.map((e: { file: string }) => basename(e.file)));
  onDisk.micro_batches.forEach((e: { file: string }, i: number) => {
    expect(Buffer.from(mem.files.get(memManifest.micro_batches[i].file)!).equals(a.get(e.file)!), e.file).toBe(true);
  });
  const { generation, ...header } = onDisk;
  expect(generation).toBe(1);
  expect(JSON.parse(Buffer.from(mem.files.get('manifest.json')!).toString())).toEqual({
    ...header,
    micro_batches: onDisk.micro_batches.map((e: { file: string }) => ({ ...e, file: basename(e.file) })),
  });
  return a;
}

describe('treepack pack and packRecords write the same bytes', () => {
  it('generated chat episodes, default options on both sides', async () => {
    const out = await compare(episodes, [], {});
    const manifest = JSON.parse(out.get('manifest.json')!.toString());
    expect(manifest.input).toBe(episodes);
    expect(manifest.absorbed).toBeGreaterThan(0);
    expect(out.size).toBeGreaterThan(1);
  }, 120_000);

  it('generated chat episodes with windows, a budget over ranks, padding, masks and another estimator', async () => {
    const out = await compare(
      episodes,
      [
        '--max-naive-tokens',
        '20000',
        '--max-tokens',
        '16384',
        '--dp',
        '2',
        '--pad-multiple',
        '64',
        '--masks',
        'block:64,slices',
        '--mask-backend',
        'js',
        '--advantages',
        'rloo',
        '--timeline-compare-level',
        'token',
      ],
      {
        windowTokens: 20000,
        budget: { maxTokens: 16384, dp: 2, padMultiple: 64 },
        masks: 'block:64,slices',
        maskBackend: 'js',
        advantages: 'rloo',
        merge: { timelineCompareLevel: 'token' },
      },
    );
    expect(JSON.parse(out.get('manifest.json')!.toString()).micro_batches.length).toBeGreaterThan(2);
  }, 120_000);

  it('pre-tokenized samples, no merge, js backend, vocabulary check', async () => {
    await compare(tokens, ['--no-merge', '--backend', 'js', '--vocab-size', '200000', '--max-naive-tokens', '5000'], {
      merge: false,
      backend: 'js',
      vocabSize: 200000,
      windowTokens: 5000,
    });
  }, 120_000);

  it('parsed records from readRecords give the same files as the path', async () => {
    const a = new MemorySink();
    const b = new MemorySink();
    await packRecords(tokens, { windowTokens: 5000 }).writeTo(a);
    await packRecords(readRecords(tokens), { windowTokens: 5000, name: tokens }).writeTo(b);
    expect([...b.files.keys()]).toEqual([...a.files.keys()]);
    for (const [name, bytes] of a.files) expect(Buffer.from(b.files.get(name)!).equals(Buffer.from(bytes)), name).toBe(true);
  }, 60_000);

  it('tau-bench airline slice: default options, and a budget over 4 ranks', async () => {
    await compare(TAU_SLICE, [], {});
    await compare(TAU_SLICE, ['--max-tokens', '16384', '--dp', '4', '--pad-multiple', '128'], {
      budget: { maxTokens: 16384, dp: 4, padMultiple: 128 },
    });
  }, 300_000);

  it('tau-bench airline slice: each micro-batch holds one node per distinct token prefix of its samples', async () => {
    // Counted here with a plain trie, not the packer's sort: the packer's figures on real agent calls, derived apart.
    for (const merge of [true, false]) {
      const run = packRecords(TAU_SLICE, { tokenizer: 'qwen3', ...(merge ? {} : { merge: false }) });
      let packed = 0,
        naive = 0;
      for await (const mb of run) {
        const root: Trie = new Map();
        let nodes = 0;
        for (const s of mb.samples) {
          let at = root;
          for (const t of s.tokens) {
            let next = at.get(t);
            if (!next) {
              next = new Map();
              at.set(t, next);
              nodes++;
            }
            at = next;
          }
          naive += s.tokens.length;
        }
        expect(mb.batch.meta.num_tokens_packed - (mb.batch.meta.num_pad_tokens ?? 0), `micro-batch ${mb.index}`).toBe(nodes);
        packed += nodes;
        // Not vacuous: every call opens with the airline policy and the 14 tool schemas, held once per micro-batch.
        const [first, ...rest] = mb.samples.map((x) => x.tokens);
        let shared = first.length;
        for (const t of rest) for (let i = 0; i < shared; i++) if (t[i] !== first[i]) shared = i;
        expect(shared).toBeGreaterThan(2000);
        expect(nodes).toBeLessThanOrEqual(mb.samples.reduce((n, x) => n + x.tokens.length, 0) - rest.length * shared);
      }
      const report = run.report();
      expect(report.packedTokens).toBe(packed);
      expect(report.naiveTokens).toBe(naive);
    }
  }, 300_000);

  it.skipIf(tauSkip !== '')(
    'tau-bench airline, the whole file: default options, and a budget over 4 ranks',
    async () => {
      await compare(TAU_BENCH, [], {});
      await compare(TAU_BENCH, ['--max-tokens', '32768', '--dp', '4', '--pad-multiple', '128'], {
        budget: { maxTokens: 32768, dp: 4, padMultiple: 128 },
      });
    },
    300_000,
  );

  it('stats --json reports the library figures', async () => {
    const r = cli(['stats', episodes, '--json', '--tokenizer', 'qwen3']);
    expect(r.code, r.stderr).toBe(0);
    const stats = JSON.parse(r.stdout);
    const run = packRecords(episodes, { tokenizer: 'qwen3', advantages: 'none', merge: { detectTimelineSnap: true } });
    let microBatches = 0;
    for await (const _ of run) microBatches++;
    const rep = run.report();
    expect(stats).toMatchObject({
      input: episodes,
      records: rep.read.lines,
      timelines: rep.timelines,
      samples: rep.samples,
      absorbed: rep.absorbed,
      merged_tokens: rep.naiveTokens,
      naive_tokens: rep.timelineTokens,
      packed_tokens: rep.packedTokens,
      snaps: rep.snaps.count,
      micro_batches: microBatches,
      tokenizer: rep.tokenizer,
      backend: rep.backend,
    });
  }, 120_000);
});

describe('bad input: the library rejects what the CLI rejects, with the same error', () => {
  const write = (name: string, lines: (object | string)[]) => {
    const f = join(dir, name);
    writeFileSync(f, lines.map((l) => (typeof l === 'string' ? l : JSON.stringify(l))).join('\n') + '\n');
    return f;
  };
  const tokenLines = readFileSync(tokens, 'utf8').trim().split('\n');
  const shortMask = JSON.parse(tokenLines[2]);
  shortMask.loss_mask = shortMask.loss_mask.slice(1);
  const cases: {
    name: string;
    lines: (object | string)[];
    args?: string[];
    opts?: PackerOptions;
    where: { line?: number; record?: string; field?: string };
  }[] = [
    { name: 'malformed JSON', lines: [tokenLines[0], '{"tokens": [1, 2,'], where: { line: 2 } },
    {
      name: 'a per-token field of the wrong length',
      lines: [tokenLines[0], tokenLines[1], shortMask],
      where: { line: 3, field: 'loss_mask' },
    },
    { name: 'an unknown record format', lines: [tokenLines[0], { prompt: 'hi' }], where: { line: 2 } },
    {
      name: 'token ids outside --vocab-size',
      lines: [{ id: 'a', tokens: [1, 2, 30] }],
      args: ['--vocab-size', '10'],
      opts: { vocabSize: 10 },
      where: { line: 1, record: 'a' },
    },
    {
      name: 'engine token ids outside the tokenizer vocabulary',
      lines: [{ messages: [{ role: 'user', content: 'hi' }], response: { role: 'assistant', content: 'ok', token_ids: [999_999_999, 5] } }],
      where: { line: 1, field: 'response.token_ids[0]' },
    },
    {
      name: 'a group repeated after its window with rewards to estimate',
      lines: [
        { id: 'a1', group: 'A', episode: 'a1', reward: 1, tokens: [1, 2, 3] },
        { id: 'b1', group: 'B', episode: 'b1', reward: 1, tokens: [1, 2, 4] },
        { id: 'a2', group: 'A', episode: 'a2', reward: 0, tokens: [1, 2, 5] },
      ],
      args: ['--max-naive-tokens', '2'],
      opts: { windowTokens: 2 },
      where: { line: 3, record: 'a2', field: 'group' },
    },
    {
      name: 'a group mixing given and estimated advantages',
      lines: [
        { id: 'a1', group: 'A', episode: 'e1', reward: 1, tokens: [1, 2, 3] },
        { id: 'a2', group: 'A', episode: 'e2', reward: 0, advantage: -5, tokens: [1, 2, 4] },
      ],
      where: { line: 2, record: 'a2', field: 'advantage' },
    },
    {
      name: 'an episode with different rewards',
      lines: [
        { id: 'a1', group: 'A', episode: 'e1', reward: 1, tokens: [1, 2, 3] },
        { id: 'a2', group: 'A', episode: 'e1', reward: 0, tokens: [1, 2, 4] },
      ],
      where: { line: 2, record: 'a2', field: 'reward' },
    },
    {
      name: 'a mask lowering the forest cannot take',
      lines: [
        { id: 'a', tokens: [1, 2, 3] },
        { id: 'b', tokens: [1, 2, 4] },
      ],
      args: ['--masks', 'cu_seqlens', '--mask-backend', 'js'],
      opts: { masks: 'cu_seqlens', maskBackend: 'js' },
      where: {},
    },
  ];

  for (const c of cases) {
    it(
      c.name,
      async () => {
        const f = write(`bad-${cases.indexOf(c)}.jsonl`, c.lines);
        const out = join(dir, `bad-out-${cases.indexOf(c)}`);
        const r = cli(['pack', f, '--out', out, '--tokenizer', 'qwen3', ...(c.args ?? [])]);
        expect(r.code).toBe(1);
        const printed = r.stderr.trim().split('\n').at(-1);
        let err: unknown;
        try {
          await packRecords(f, { tokenizer: 'qwen3', ...c.opts }).writeTo(new DirectorySink(join(dir, `bad-lib-${cases.indexOf(c)}`)));
        } catch (e) {
          err = e;
        }
        expect(err).toBeInstanceOf(TreepackError);
        const e = err as TreepackError;
        expect(e.code).not.toBe('E_ARG'); // exit code 1, as the CLI's
        expect(`treepack pack: ${e.message}`).toBe(printed);
        if (c.where.line !== undefined) expect(e.where.file).toBe(f);
        expect(e.where).toMatchObject(c.where);
        // Neither side created its output directory (a failed run leaves --out exactly as it was).
        expect(existsSync(out)).toBe(false);
        expect(existsSync(join(dir, `bad-lib-${cases.indexOf(c)}`))).toBe(false);
        // Incremental use, JSON objects pushed line by line, meets the same error (malformed JSON cannot be pushed).
        if (c.name === 'malformed JSON') return;
        const packer = createPacker({ tokenizer: 'qwen3', ...c.opts, name: f });
        let inc: unknown;
        try {
          for (const l of c.lines) packer.push(typeof l === 'string' ? JSON.parse(l) : l);
          await packer.end();
        } catch (e2) {
          inc = e2;
        }
        expect(inc).toBeInstanceOf(TreepackError);
        expect((inc as TreepackError).message).toBe(e.message);
      },
      60_000,
    );
  }

  it('a failed run leaves the previous output as it was', async () => {
    const out = join(dir, 'keep');
    await packRecords(tokens, {}).writeTo(new DirectorySink(out));
    const before = files(out);
    const bad = write('bad-keep.jsonl', [tokenLines[0], tokenLines[1], shortMask]);
    await expect(packRecords(bad, {}).writeTo(new DirectorySink(out))).rejects.toThrow(/bad-keep\.jsonl:3/);
    const after = files(out);
    expect([...after.keys()]).toEqual([...before.keys()]);
    for (const [name, bytes] of before) expect(after.get(name)!.equals(bytes), name).toBe(true);
  }, 60_000);
});
