/** Readers (every input format and every rejection), the streaming line reader, and the rollout generators. */
import { createReadStream, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Readable } from 'node:stream';
import { afterAll, describe, expect, it } from 'vitest';
import { TreepackError } from '../src/errors.js';
import { generateEpisodes, generateJsonl, generateTokenSamples, type EpisodeJson } from '../bench/dataset.js';
import { readJsonlLines } from '../src/records/jsonl.js';
import { parseRecords, readRecords, type ReadOptions, type ReadStats } from '../src/records/read.js';
import type { ChatRecord, Sample, TrainRecord } from '../src/records/types.js';

const dir = mkdtempSync(join(tmpdir(), 'treepack-records-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
let fileCount = 0;

function tempFile(content: string | Buffer): string {
  const file = join(dir, `in-${fileCount++}.jsonl`);
  writeFileSync(file, content);
  return file;
}

async function collect<T>(gen: AsyncIterable<T>): Promise<T[]> {
  const out: T[] = [];
  for await (const x of gen) out.push(x);
  return out;
}

/** Records of `lines` read from a stream named "t.jsonl", so ids and error locations are predictable. */
function readLines(lines: string[], opts: ReadOptions = {}): Promise<TrainRecord[]> {
  return collect(readRecords(Readable.from([lines.join('\n') + '\n']), { name: 't.jsonl', ...opts }));
}

async function rejection(lines: string[], opts: ReadOptions = {}): Promise<TreepackError> {
  try {
    await readLines(lines, opts);
  } catch (e) {
    expect(e).toBeInstanceOf(TreepackError);
    return e as TreepackError;
  }
  throw new Error('expected a rejection');
}

const samples = (rs: TrainRecord[]) => rs as Sample[];
const chats = (rs: TrainRecord[]) => rs as ChatRecord[];

describe('readJsonlLines', () => {
  it('handles CRLF, a BOM, blank lines and a missing final newline, keeping physical line numbers', async () => {
    const text = '\ufeff{"a":1}\r\n\r\n   \n{"b":"é"}\r\n\n{"c":3}';
    const lines = await collect(readJsonlLines(Readable.from([Buffer.from(text)])));
    expect(lines).toEqual([
      { line: 1, text: '{"a":1}' },
      { line: 4, text: '{"b":"é"}' },
      { line: 6, text: '{"c":3}' },
    ]);
  });

  it('reassembles multi-byte characters and long lines split across tiny chunks', async () => {
    const long = JSON.stringify({ text: '你好 héllo 🙂 '.repeat(40_000) }); // ~600 KB, longer than an episode line
    const file = tempFile(`${long}\n{"x":"🙂"}\n`);
    // Chunk sizes coprime with the 1–4 byte characters, so chunk edges fall inside characters many times.
    for (const highWaterMark of [1021, 7]) {
      const text = highWaterMark === 7 ? long.slice(0, 20_000) + '"}' : long;
      writeFileSync(file, `${text}\n{"x":"🙂"}\n`);
      const lines = await collect(readJsonlLines(createReadStream(file, { highWaterMark }), { name: file }));
      expect(lines.map((l) => l.text)).toEqual([text, '{"x":"🙂"}']);
    }
  });

  it('rejects a line over maxLineBytes with E_LIMIT naming the line, and counts a CRLF as no content', async () => {
    const ok = await collect(readJsonlLines(Readable.from(['1234567890\r\n']), { maxLineBytes: 10 }));
    expect(ok).toEqual([{ line: 1, text: '1234567890' }]);
    const err = await collect(
      readJsonlLines(Readable.from(['{}\n', 'x'.repeat(5), 'x'.repeat(7), '\n']), { maxLineBytes: 10, name: 's' }),
    ).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(TreepackError);
    expect((err as TreepackError).code).toBe('E_LIMIT');
    expect((err as TreepackError).message).toMatch(/^s:2: line longer than 10 bytes/);
  });

  it('reports a missing file as E_IO', async () => {
    const err = await collect(readJsonlLines(join(dir, 'nope.jsonl'))).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(TreepackError);
    expect((err as TreepackError).code).toBe('E_IO');
    expect((err as TreepackError).message).toContain('nope.jsonl');
  });
});

describe('readRecords: formats', () => {
  it('reads pre-tokenized samples into typed arrays, forcing loss_mask[0] = 0', async () => {
    const rs = samples(
      await readLines([
        JSON.stringify({ tokens: [5, 6, 7, 8] }),
        JSON.stringify({
          id: 'a',
          group: 'g',
          tokens: [1, 2, 3],
          loss_mask: [1, 0, 1],
          rollout_logprobs: [0, -0.5, -1.25],
          old_logprobs: [0, -0.25, 0.0005],
          ref_logprobs: [0, -1, -2],
          advantages: [0, 1.5, -2],
          advantage: 0.5,
          reward: 1,
          extra: { ignored: true },
        }),
        JSON.stringify({ id: 7, tokens: [], episode: 'e' }),
      ]),
    );
    expect(rs).toHaveLength(3);
    const [d, a, e] = rs;
    expect(d).toMatchObject({
      kind: 'sample',
      id: 't.jsonl:1',
      group: 't.jsonl:1',
      episode: 't.jsonl:1',
      source: { file: 't.jsonl', line: 1 },
    });
    expect(d.tokens).toEqual(new Int32Array([5, 6, 7, 8]));
    expect(d.loss_mask).toEqual(new Uint8Array([0, 1, 1, 1]));
    expect(d.rollout_logprobs).toBeUndefined();
    expect(a).toMatchObject({ id: 'a', group: 'g', episode: 'a', reward: 1, advantage: 0.5 });
    expect(a.loss_mask).toEqual(new Uint8Array([0, 0, 1]));
    expect(a.rollout_logprobs).toEqual(new Float32Array([0, -0.5, -1.25]));
    expect(a.old_logprobs).toEqual(new Float32Array([0, -0.25, 0.0005]));
    expect(a.ref_logprobs).toEqual(new Float32Array([0, -1, -2]));
    expect(a.advantages).toEqual(new Float32Array([0, 1.5, -2]));
    expect(e).toMatchObject({ id: '7', group: '7', episode: 'e' });
    expect(e.tokens.length).toBe(0);
  });

  it('reads slime samples, expanding response-only arrays over the prompt', async () => {
    const [s, t] = samples(
      await readLines([
        JSON.stringify({
          index: 12,
          group_index: 3,
          tokens: [10, 11, 12, 13, 14],
          response_length: 3,
          loss_mask: [1, 0, 1],
          rollout_log_probs: [-0.5, -0.25, -1],
          reward: 0.5,
          prompt: 'ignored',
          status: 'completed',
        }),
        JSON.stringify({ tokens: [1, 2], response_length: 2 }),
      ]),
    );
    expect(s).toMatchObject({ id: '12', group: '3', episode: '12', reward: 0.5 });
    expect(s.loss_mask).toEqual(new Uint8Array([0, 0, 1, 0, 1]));
    expect(s.rollout_logprobs).toEqual(new Float32Array([0, 0, -0.5, -0.25, -1]));
    expect(t.loss_mask).toEqual(new Uint8Array([0, 1])); // the whole sequence is response: token 0 still forced off
  });

  it('reads single chat records, flattening text parts and defaulting ids', async () => {
    const [c, d] = chats(
      await readLines([
        JSON.stringify({
          id: 'c1',
          group: 'task',
          episode: 'ep',
          reward: 0,
          messages: [
            {
              role: 'system',
              content: [
                { type: 'text', text: 'You are ' },
                { type: 'text', text: 'helpful.' },
              ],
            },
            { role: 'user', content: 'weather?' },
            {
              role: 'assistant',
              content: null,
              tool_calls: [{ id: 'x', type: 'function', function: { name: 'w', arguments: { city: 'Paris' } } }],
            },
            { role: 'tool', content: '{"t": 20}', tool_call_id: 'x', name: 'w' },
          ],
          tools: [{ type: 'function', function: { name: 'w', parameters: {} } }],
          response: { role: 'assistant', content: 'It is 20 °C.', reasoning_content: 'easy' },
        }),
        JSON.stringify({ messages: [{ role: 'user', content: 'hi' }], response: 'hello' }),
      ]),
    );
    expect(c).toMatchObject({ kind: 'chat', id: 'c1', group: 'task', episode: 'ep', reward: 0 });
    expect(c.messages[0]).toEqual({ role: 'system', content: 'You are helpful.' });
    expect(c.messages[2].tool_calls![0].function.arguments).toEqual({ city: 'Paris' });
    expect(c.messages[3]).toEqual({ role: 'tool', content: '{"t": 20}', tool_call_id: 'x', name: 'w' });
    expect(c.response).toEqual({ role: 'assistant', content: 'It is 20 °C.', reasoning_content: 'easy' });
    expect(c.tools).toHaveLength(1);
    expect(d).toMatchObject({
      id: 't.jsonl:2',
      group: 't.jsonl:2',
      episode: 't.jsonl:2',
      response: { role: 'assistant', content: 'hello' },
    });
    expect(d.reward).toBeUndefined();
  });

  it('reads an episode as one chat record per request', async () => {
    const episode = {
      source: 'x',
      task_id: 'airline-1',
      episode_id: 'airline-1-trial0',
      meta: { reward: 1.0, trial: 0 },
      requests: [
        { agent: 'a', messages: [{ role: 'user', content: 'q1' }], tools: null, response: { role: 'assistant', content: 'r1' } },
        {
          agent: 'a',
          messages: [
            { role: 'user', content: 'q1' },
            { role: 'assistant', content: 'r1' },
            { role: 'user', content: 'q2' },
          ],
          tools: null,
          response: { role: 'assistant', content: 'r2' },
        },
      ],
    };
    const stats: ReadStats = { lines: 0, records: 0 };
    const rs = chats(
      await readLines([JSON.stringify(episode), JSON.stringify({ ...episode, task_id: undefined, group: 'G', episode_id: undefined })], {
        stats,
      }),
    );
    expect(stats).toEqual({ lines: 2, records: 4 });
    expect(rs.map((r) => [r.id, r.group, r.episode, r.reward, r.agent])).toEqual([
      ['airline-1-trial0/0', 'airline-1', 'airline-1-trial0', 1, 'a'],
      ['airline-1-trial0/1', 'airline-1', 'airline-1-trial0', 1, 'a'],
      ['t.jsonl:2/0', 'G', 't.jsonl:2', 1, 'a'],
      ['t.jsonl:2/1', 'G', 't.jsonl:2', 1, 'a'],
    ]);
    expect(rs[1].messages.map((m) => m.content)).toEqual(['q1', 'r1', 'q2']);
  });

  it('names default ids after the path for files and line-N for unnamed streams', async () => {
    const line = JSON.stringify({ tokens: [1, 2] });
    const file = tempFile(`${line}\n\n${line}\n`);
    expect((await collect(readRecords(file))).map((r) => r.id)).toEqual([`${file}:1`, `${file}:3`]);
    expect((await collect(readRecords(Readable.from([`${line}\n${line}`])))).map((r) => r.id)).toEqual(['line-1', 'line-2']);
  });

  it('parses the generators’ output', async () => {
    const episodes = [...generateEpisodes({ groups: 2, episodesPerGroup: 3, minTurns: 3, maxTurns: 5 })];
    const rs = chats(
      await collect(readRecords(Readable.from([generateJsonl({ groups: 2, episodesPerGroup: 3, minTurns: 3, maxTurns: 5 })]))),
    );
    expect(rs).toHaveLength(episodes.reduce((n, e) => n + e.requests.length, 0));
    expect(rs[0]).toMatchObject({ id: 'task-0-ep0/0', group: 'task-0', episode: 'task-0-ep0', agent: 'airline_agent' });
    const toks = samples(
      await readLines(
        [...generateTokenSamples({ groups: 1, episodesPerGroup: 2, minTurns: 2, maxTurns: 3 })].map((s) => JSON.stringify(s)),
        { vocabSize: 151643 },
      ),
    );
    expect(toks[0]).toMatchObject({ id: 'task-0-ep0/0', group: 'task-0', episode: 'task-0-ep0' });
    expect(toks[0].rollout_logprobs).toBeInstanceOf(Float32Array);
  });
});

describe('readRecords: rejections', () => {
  const chat = (over: Record<string, unknown>) =>
    JSON.stringify({ messages: [{ role: 'user', content: 'q' }], response: { role: 'assistant', content: 'a' }, ...over });
  const msg = (m: unknown) => chat({ messages: [{ role: 'user', content: 'q' }, m] });
  const call = (c: unknown) => msg({ role: 'assistant', content: null, tool_calls: [c] });
  const cases: [name: string, line: string, field: string | undefined, message: RegExp][] = [
    ['malformed JSON', '{"tokens": [1, 2', undefined, /malformed JSON: .*JSON/],
    ['not an object', '[1, 2, 3]', undefined, /expected a JSON object per line, got an array of length 3/],
    ['unknown format', '{"prompt": "x", "answer": "y"}', undefined, /unknown record format.*"prompt", "answer"/],
    ['tokens not an array', '{"tokens": "1 2 3"}', 'tokens', /expected an array of token ids/],
    ['negative token', '{"tokens": [1, -3]}', 'tokens[1]', /got -3 of type number/],
    ['fractional token', '{"tokens": [1, 2, 2.5]}', 'tokens[2]', /got 2\.5/],
    ['token over int32', '{"tokens": [2147483648]}', 'tokens[0]', /0\.\.2147483647/],
    ['string token', '{"tokens": [1, "2"]}', 'tokens[1]', /got "2" of type string/],
    ['loss_mask length', '{"tokens": [1, 2, 3], "loss_mask": [0, 1]}', 'loss_mask', /expected 3 values \(one per token\), got 2/],
    ['loss_mask value', '{"tokens": [1, 2], "loss_mask": [0, 2]}', 'loss_mask[1]', /expected 0 or 1, got 2/],
    ['logprob string', '{"tokens": [1, 2], "old_logprobs": [0, "NaN"]}', 'old_logprobs[1]', /expected a finite number, got "NaN"/],
    ['logprob null', '{"tokens": [1, 2], "ref_logprobs": [null, -1]}', 'ref_logprobs[0]', /expected a finite number, got null/],
    ['logprob positive', '{"tokens": [1, 2], "rollout_logprobs": [0, 0.7]}', 'rollout_logprobs[1]', /must be ≤ 0, got 0\.7/],
    ['advantages length', '{"tokens": [1, 2], "advantages": [1]}', 'advantages', /expected 2 values/],
    ['advantages infinite', '{"tokens": [1, 2], "advantages": [1, "Infinity"]}', 'advantages[1]', /finite number/],
    ['reward type', '{"tokens": [1], "reward": "high"}', 'reward', /expected a finite number, got "high"/],
    ['id type', '{"tokens": [1], "id": {"a": 1}}', 'id', /string or integer id/],
    ['response_length too long', '{"tokens": [1, 2], "response_length": 3}', 'response_length', /larger than the number of tokens \(2\)/],
    ['response_length type', '{"tokens": [1, 2], "response_length": -1}', 'response_length', /non-negative integer/],
    [
      'slime mask length',
      '{"tokens": [1, 2, 3], "response_length": 2, "loss_mask": [1, 1, 1]}',
      'loss_mask',
      /expected 2 values \(one per response token, response_length = 2\), got 3/,
    ],
    [
      'slime logprobs length',
      '{"tokens": [1, 2, 3], "response_length": 2, "rollout_log_probs": [-1]}',
      'rollout_log_probs',
      /expected 2 values/,
    ],
    ['messages not an array', chat({ messages: 'hi' }), 'messages', /expected an array of messages/],
    ['message without role', msg({ content: 'x' }), 'messages[1].role', /expected a role string, got undefined/],
    ['bad content', msg({ role: 'user', content: 42 }), 'messages[1].content', /string, null or an array of content parts/],
    [
      'image part without a URL',
      msg({ role: 'user', content: [{ type: 'image_url', image_url: {} }] }),
      'messages[1].content[0].image_url.url',
      /expected an image URL string, got undefined/,
    ],
    [
      'audio part',
      msg({ role: 'user', content: [{ type: 'input_audio', input_audio: {} }] }),
      'messages[1].content[0]',
      /got a part of type "input_audio"/,
    ],
    ['tool_calls not an array', msg({ role: 'assistant', content: null, tool_calls: {} }), 'messages[1].tool_calls', /array of tool calls/],
    ['tool call without function', call({ id: 'x' }), 'messages[1].tool_calls[0].function', /expected \{"name", "arguments"\}/],
    ['tool call without name', call({ function: { arguments: '{}' } }), 'messages[1].tool_calls[0].function.name', /function name/],
    [
      'tool call bad arguments',
      call({ function: { name: 'f', arguments: 3 } }),
      'messages[1].tool_calls[0].function.arguments',
      /JSON string or an object/,
    ],
    ['tool_call_id type', msg({ role: 'tool', content: 'r', tool_call_id: 5 }), 'messages[1].tool_call_id', /expected a string/],
    ['response missing', chat({ response: undefined }), 'response', /expected a message object, got undefined/],
    ['response role', chat({ response: { role: 'user', content: 'x' } }), 'response.role', /expected role "assistant"/],
    ['tools type', chat({ tools: { a: 1 } }), 'tools', /array of tool schemas/],
    ['chat reward type', chat({ reward: 'high' }), 'reward', /finite number/],
    ['requests type', '{"episode_id": "e", "requests": {}}', 'requests', /array of requests/],
    ['episode reward type', '{"episode_id": "e", "meta": {"reward": "1"}, "requests": []}', 'meta.reward', /finite number/],
    [
      'episode request field',
      '{"episode_id": "e", "requests": [{"messages": [{"role": "user", "content": "q"}], "response": {"content": 1}}]}',
      'requests[0].response.content',
      /string, null or an array/,
    ],
  ];

  it.each(cases)('%s', async (_name, line, field, message) => {
    const err = await rejection(['{"tokens": [1, 2]}', '', line]);
    expect(err.code).toBe('E_INPUT');
    expect(err.where).toMatchObject({ file: 't.jsonl', line: 3 });
    expect(err.where.field).toBe(field);
    expect(err.message).toMatch(/^t\.jsonl:3/);
    if (field) expect(err.message).toContain(`field ${JSON.stringify(field)}`);
    expect(err.message).toMatch(message);
  });

  it('names the record, episode request and token index', async () => {
    let err = await rejection(['{"id": "s1", "tokens": [0, 151643]}'], { vocabSize: 151643 });
    expect(err.message).toBe('t.jsonl:1, record "s1", field "tokens[1]": token id 151643 is outside the vocabulary (size 151643)');
    err = await rejection(['{"episode_id": "ep", "requests": [{"messages": [], "response": "a"}, {"messages": [3], "response": "a"}]}']);
    expect(err.where).toEqual({ file: 't.jsonl', line: 1, record: 'ep/1', field: 'requests[1].messages[0]' });
  });

  it('allows a tool message without tool_call_id and a tool call without arguments', async () => {
    const messages = [
      { role: 'user', content: 'q' },
      { role: 'assistant', content: null, tool_calls: [{ function: { name: 'f' } }] },
      { role: 'tool', content: 'r' },
    ];
    const [r] = chats(await readLines([chat({ messages })]));
    expect(r.messages[2]).toEqual({ role: 'tool', content: 'r' });
    expect(r.messages[1].tool_calls![0].function).toEqual({ name: 'f', arguments: {} });
  });
});

describe('readRecords: streaming', () => {
  /** 2000 varied lines (every format, blank lines, CRLF) from a seeded generator. */
  function mixedLines(): string {
    let s = 7;
    const rnd = () => (s = (Math.imul(s, 1103515245) + 12345) >>> 0) / 2 ** 32;
    const ints = (n: number) => Array.from({ length: n }, () => Math.floor(rnd() * 151643));
    const ep: EpisodeJson = generateEpisodes({ groups: 1, episodesPerGroup: 1, minTurns: 3, maxTurns: 3 }).next().value;
    const out: string[] = [];
    for (let i = 0; out.length < 2000; i++) {
      const k = i % 5;
      const n = 1 + Math.floor(rnd() * 300);
      if (k === 0)
        out.push(JSON.stringify({ tokens: ints(n), loss_mask: ints(n).map((x) => x & 1), rollout_logprobs: ints(n).map((x) => -x / 1e5) }));
      else if (k === 1) out.push(JSON.stringify({ tokens: ints(n), response_length: Math.floor(n / 2), index: i, group_index: i >> 3 }));
      else if (k === 2)
        out.push(
          JSON.stringify({
            messages: [{ role: 'user', content: '¿qué? 你好 '.repeat(n) }],
            response: { role: 'assistant', content: 'ok' },
            group: `g${i >> 4}`,
          }),
        );
      else if (k === 3) out.push(i % 400 === 3 ? JSON.stringify(ep) : '');
      else out.push(JSON.stringify({ id: `s${i}`, tokens: ints(n) }) + (i % 3 === 0 ? '\r' : ''));
    }
    return out.join('\n');
  }

  it('gives the same records from a path, a tiny-chunk stream and random-size chunks', async () => {
    const text = mixedLines();
    const file = tempFile(text);
    const stats: ReadStats = { lines: 0, records: 0 };
    const fromPath = await collect(readRecords(file, { stats }));
    expect(stats.lines).toBe(1600 + 5);
    expect(stats.records).toBe(1600 + 5 * 3);
    const fromStream = await collect(readRecords(createReadStream(file, { highWaterMark: 127 }), { name: file }));
    expect(fromStream).toEqual(fromPath);
    const buf = Buffer.from(text);
    const chunks: Buffer[] = [];
    for (let at = 0, i = 0; at < buf.length; i++) chunks.push(buf.subarray(at, (at += 1 + ((i * 7919) % 5000))));
    expect(await collect(readRecords(Readable.from(chunks), { name: file }))).toEqual(fromPath);
  });
});

describe('generators', () => {
  const opts = { groups: 3, seed: 5 };
  const episodes = [...generateEpisodes(opts)];

  it('is deterministic per seed and group', () => {
    expect(JSON.stringify([...generateEpisodes(opts)])).toBe(JSON.stringify(episodes));
    expect(JSON.stringify([...generateEpisodes({ ...opts, groups: 1 })])).toBe(JSON.stringify(episodes.slice(0, 8)));
    expect(JSON.stringify([...generateEpisodes({ ...opts, seed: 6 })])).not.toBe(JSON.stringify(episodes));
    expect(generateJsonl({ groups: 1, episodesPerGroup: 2, minTurns: 2, maxTurns: 2 }).split('\n')).toHaveLength(3);
  });

  it('has the tau-bench shape: groups of 8, 10–30 turns, shared prompts, diverging episodes, truncation', () => {
    expect(episodes).toHaveLength(24);
    const system = episodes[0].requests[0].messages[0].content!;
    expect(system.length).toBeGreaterThan(5000); // a few thousand tokens with the tool schemas
    for (const [i, ep] of episodes.entries()) {
      const g = Math.floor(i / 8);
      expect(ep.task_id).toBe(`task-${g}`);
      expect(ep.requests.length).toBeGreaterThanOrEqual(10);
      expect(ep.requests.length).toBeLessThanOrEqual(30);
      expect(ep.requests[0].messages[0].content).toBe(system);
      expect(ep.requests[0].messages[1].content).toBe(episodes[g * 8].requests[0].messages[1].content);
      const truncatedFrom = ep.meta.truncated_from ?? ep.requests.length;
      expect(truncatedFrom < ep.requests.length).toBe(i % 4 === 3);
      for (let k = 0; k + 1 < ep.requests.length; k++) {
        const a = ep.requests[k];
        const b = ep.requests[k + 1];
        const extends_ = JSON.stringify([...a.messages, a.response]) === JSON.stringify(b.messages.slice(0, a.messages.length + 1));
        expect(extends_).toBe(k + 1 < truncatedFrom);
        if (a.response.tool_calls) {
          const c = a.response.tool_calls[0];
          expect(JSON.parse(c.function.arguments)).toBeTypeOf('object');
          expect(ep.requests[k + 1].messages.at(-1)).toMatchObject({ role: 'tool', tool_call_id: c.id });
        }
      }
    }
    // Episodes of a group diverge after the shared first user message.
    const firstReplies = new Set(episodes.slice(0, 8).map((e) => JSON.stringify(e.requests[0].response)));
    expect(firstReplies.size).toBe(8);
  });

  it('token samples: ids below 151643, requests extending each other, a group sharing its prompt', () => {
    const ts = [...generateTokenSamples({ groups: 2, seed: 3 })];
    const plan = [...generateEpisodes({ groups: 2, seed: 3 })];
    expect(ts).toHaveLength(plan.reduce((n, e) => n + e.requests.length, 0));
    let i = 0;
    for (const ep of plan) {
      const truncatedFrom = ep.meta.truncated_from ?? ep.requests.length;
      for (let k = 0; k < ep.requests.length; k++, i++) {
        const s = ts[i];
        expect(s.id).toBe(`${ep.episode_id}/${k}`);
        expect(s.loss_mask).toHaveLength(s.tokens.length);
        expect(s.tokens.every((t) => Number.isInteger(t) && t >= 0 && t < 151643)).toBe(true);
        expect(s.loss_mask[0]).toBe(0);
        if (k > 0) {
          const prev = ts[i - 1].tokens;
          if (k < truncatedFrom) expect(s.tokens.slice(0, prev.length)).toEqual(prev);
          else expect(s.tokens.slice(0, prev.length)).not.toEqual(prev);
        }
      }
    }
    // Same group: same first 3000+ tokens (system + first user turn); other group: only the system prompt.
    const prefix = (a: number[], b: number[]) => {
      let n = 0;
      while (n < a.length && a[n] === b[n]) n++;
      return n;
    };
    const a = ts[0].tokens;
    const b = ts.find((s) => s.episode === 'task-0-ep1')!.tokens;
    const c = ts.find((s) => s.group === 'task-1')!.tokens;
    expect(prefix(a, b)).toBeGreaterThan(3060);
    expect(prefix(a, c)).toBeLessThan(3010);
    expect(parseRecords(ts[0], { file: 'x', line: 1 }, { vocabSize: 151643 })).toHaveLength(1);
  });
});
