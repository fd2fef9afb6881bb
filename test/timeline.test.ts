/**
 * Timeline merge: the scenarios AgentJet documents (chain, branch, author toggle, text vs token compare, tool
 * schemas, tool calls, drift), the snap diagnostic, bad input, and a property test against a brute-force oracle:
 * every (context, trainable token, logprob) of every input is in the output, nothing else is trainable, the
 * forest of the merged samples equals the forest of the inputs, and input order changes nothing.
 */
import { describe, expect, it } from 'vitest';
import { TreepackError } from '../src/errors.js';
import { toSequences } from '../src/pack/batch.js';
import { packForest } from '../src/pack/forest.js';
import { sampleTurnIds } from '../src/pack/turns.js';
import { parseRecords } from '../src/records/read.js';
import type { ChatRecord, Sample } from '../src/records/types.js';
import { timelineFromChat, timelineFromSample, timelineToSample } from '../src/timeline/build.js';
import { mergeTimelines } from '../src/timeline/merge.js';
import { addSnaps, emptySnapSummary, type Snap } from '../src/timeline/snap.js';
import { mergeDefaults, type Author, type MergeOptions, type Timeline, type TimelineMessage } from '../src/timeline/model.js';
import { ChatEncoder } from '../src/tokenize/chat.js';
import { loadTokenizer } from '../src/tokenize/tokenizer.js';
import { caught } from './helpers/errors.js';
import { csr, rng, shuffled } from './helpers/sequences.js';

const encoder = new ChatEncoder(await loadTokenizer('qwen3'));

function msg(author: Author, text: string, tokens: number[], logprobs?: number[]): TimelineMessage {
  const lossMask = new Uint8Array(tokens.length).fill(author === 'llm' ? 1 : 0);
  const m: TimelineMessage = {
    author,
    role: author === 'llm' || author === 'env' ? 'assistant' : 'user',
    text,
    calls: '',
    tokens: Int32Array.from(tokens),
    lossMask,
  };
  if (logprobs) m.logprobs = Float32Array.from(logprobs);
  return m;
}

function tl(id: string, messages: TimelineMessage[], extra: Partial<Timeline> = {}): Timeline {
  return { id, group: 'g', episode: 'e', tools: '', messages, source: { file: 't', line: 1 }, ...extra };
}

const sys = () => msg('initialization', 'sys', [1, 2, 3]);
const user = (k: number) => msg('user', `u${k}`, [10 + k, 10 + k]);
const sampled = (k: number) => msg('llm', `a${k}`, [100 + k, 200 + k], [-0.5 - k, -0.25]);
const context = (k: number) => msg('env', `a${k}`, [100 + k, 200 + k]);

const arr = (a: ArrayLike<number> | undefined) => (a ? Array.from(a) : undefined);

describe('timeline merge scenarios', () => {
  it('an append-only chain becomes one sample that trains every response with its own logprobs', () => {
    const ts = [
      tl('e/0', [sys(), user(1), sampled(1)]),
      tl('e/1', [sys(), user(1), context(1), user(2), sampled(2)]),
      tl('e/2', [sys(), user(1), context(1), user(2), context(2), user(3), sampled(3)]),
    ];
    const { samples, report } = mergeTimelines(ts);
    expect(samples.length).toBe(1);
    const s = samples[0];
    expect(s.id).toBe('e/2');
    expect(s.merged_from).toEqual(['e/0', 'e/1']);
    expect(arr(s.tokens)).toEqual([1, 2, 3, 11, 11, 101, 201, 12, 12, 102, 202, 13, 13, 103, 203]);
    expect(arr(s.loss_mask)).toEqual([0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1]);
    expect(arr(s.rollout_logprobs)).toEqual([0, 0, 0, 0, 0, -1.5, -0.25, 0, 0, -2.5, -0.25, 0, 0, -3.5, -0.25]);
    // Each response is its own turn; context tokens carry the id of the turn before them (-1 before the first).
    expect(arr(s.turn_starts)).toEqual([5, 9, 13]);
    expect(arr(sampleTurnIds(s))).toEqual([-1, -1, -1, -1, -1, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2]);
    expect(report).toMatchObject({ timelines: 3, samples: 1, absorbed: 2, apart: 0, driftedMessages: 0 });
  });

  it('timelines with and without rollout logprobs merge separately instead of failing as one sample', () => {
    const plain = (k: number) => msg('llm', `b${k}`, [300 + k, 400 + k]);
    const ts = [
      tl('e/0', [sys(), user(1), sampled(1)]),
      tl('e/1', [sys(), user(1), context(1), user(2), plain(2)]),
      tl('e/2', [sys(), user(1)]),
    ];
    const { samples, report } = mergeTimelines(ts, { detectTimelineSnap: true });
    // e/2 trains nothing: it joins the logprob kind and is absorbed there.
    expect(samples.map((s) => [s.id, s.merged_from])).toEqual([
      ['e/0', ['e/2']],
      ['e/1', undefined],
    ]);
    expect(arr(samples[0].rollout_logprobs)).toEqual([0, 0, 0, 0, 0, -1.5, -0.25]);
    expect(samples[1].rollout_logprobs).toBeUndefined();
    expect(arr(samples[1].loss_mask)).toEqual([0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]);
    expect(report).toMatchObject({ timelines: 3, samples: 2, absorbed: 1 });
    // Snaps still see the whole episode: e/2 goes back before e/1's turns.
    expect(report.snaps.map((x) => [x.record, x.kind])).toEqual([['e/2', 'rollback']]);
  });

  it('a branch gives two samples and the shared response is trained in exactly one', () => {
    const ts = [
      tl('e/0', [sys(), user(1), sampled(1)]),
      tl('e/1', [sys(), user(1), context(1), user(2), sampled(2)]),
      tl('e/1b', [sys(), user(1), context(1), user(3), sampled(3)]),
    ];
    const { samples, report } = mergeTimelines(ts);
    expect(samples.map((s) => s.id)).toEqual(['e/1', 'e/1b']);
    // The canonical leaf is the child with the smaller identity: "u2" < "u3".
    expect(samples[0].merged_from).toEqual(['e/0']);
    expect(samples[1].merged_from).toBeUndefined();
    expect(arr(samples[0].loss_mask)).toEqual([0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 1]);
    expect(arr(samples[1].loss_mask)).toEqual([0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]);
    expect(report.absorbed).toBe(1);
  });

  it('author toggle: the absorbed timeline’s sampled tokens and logprobs replace the drifted context copy', () => {
    const drifted = msg('env', 'a1', [7, 100 + 1, 200 + 1]); // the same text re-rendered with an extra token
    const ts = [tl('e/0', [sys(), user(1), sampled(1)]), tl('e/1', [sys(), user(1), drifted, user(2), sampled(2)])];
    const text = mergeTimelines(ts);
    expect(text.samples.length).toBe(1);
    expect(arr(text.samples[0].tokens)).toEqual([1, 2, 3, 11, 11, 101, 201, 12, 12, 102, 202]);
    expect(arr(text.samples[0].loss_mask)).toEqual([0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 1]);
    expect(text.report.driftedMessages).toBe(1);
    // Token compare sees two different messages: nothing merges.
    const token = mergeTimelines(ts, { timelineCompareLevel: 'token' });
    expect(token.samples.map((s) => s.id)).toEqual(['e/0', 'e/1']);
    expect(arr(token.samples[1].tokens)).toEqual([1, 2, 3, 11, 11, 7, 101, 201, 12, 12, 102, 202]);
    // Without drift, token compare merges and toggles the author as well.
    const same = mergeTimelines([ts[0], tl('e/1', [sys(), user(1), context(1), user(2), sampled(2)])], { timelineCompareLevel: 'token' });
    expect(same.samples.length).toBe(1);
    expect(arr(same.samples[0].rollout_logprobs)!.slice(5, 7)).toEqual([-1.5, -0.25]);
  });

  it('fixRetokenizationDrift decides whether other branches see the sampled tokens or their own re-rendering', () => {
    const drifted = () => msg('env', 'a1', [7, 101, 201]);
    const ts = [
      tl('e/0', [sys(), user(1), sampled(1)]),
      tl('e/1', [sys(), user(1), drifted(), user(2), sampled(2)]),
      tl('e/2', [sys(), user(1), drifted(), user(3), sampled(3)]),
    ];
    const on = mergeTimelines(ts);
    const off = mergeTimelines(ts, { fixRetokenizationDrift: false });
    expect(on.samples.map((s) => arr(s.tokens)!.slice(5, 8))).toEqual([
      [101, 201, 12],
      [101, 201, 13],
    ]);
    // Off: only the sample that absorbed e/0 (the toggle) carries its tokens; e/2 keeps its own rendering.
    expect(off.samples.map((s) => arr(s.tokens)!.slice(5, 8))).toEqual([
      [101, 201, 12],
      [7, 101, 201],
    ]);
  });

  it('a message sampled twice with the same text but other tokens is never merged away', () => {
    const other = msg('llm', 'a1', [100 + 1, 201], [-0.75, -0.125]); // same text and tokens, other logprobs
    const ts = [
      tl('e/0', [sys(), user(1), sampled(1)]),
      tl('e/0b', [sys(), user(1), other]),
      tl('e/1', [sys(), user(1), context(1), user(2), sampled(2)]),
    ];
    const { samples, report } = mergeTimelines(ts);
    expect(report).toMatchObject({ samples: 2, absorbed: 1, apart: 1 });
    // Both sampled versions are trained, each in one sample.
    const lps = samples.map((s) => arr(s.rollout_logprobs)!.slice(5, 7).join());
    expect(lps.sort()).toEqual(['-0.75,-0.125', '-1.5,-0.25']);
  });

  it('merges only within one episode, agent, reward and advantage; an option shares across agents', () => {
    const a = (id: string, extra: Partial<Timeline>, ms: TimelineMessage[]) => tl(id, ms, extra);
    const short = [sys(), user(1), sampled(1)];
    const long = [sys(), user(1), context(1), user(2), sampled(2)];
    expect(mergeTimelines([a('x', { episode: 'e1' }, short), a('y', { episode: 'e2' }, long)]).samples.length).toBe(2);
    expect(mergeTimelines([a('x', { reward: 1 }, short), a('y', { reward: 0 }, long)]).samples.length).toBe(2);
    expect(mergeTimelines([a('x', { advantage: 1 }, short), a('y', { advantage: -1 }, long)]).samples.length).toBe(2);
    const agents = [a('x', { agent: 'planner' }, short), a('y', { agent: 'coder' }, long)];
    expect(mergeTimelines(agents).samples.length).toBe(2);
    expect(mergeTimelines(agents, { shareAcrossAgents: true }).samples.length).toBe(1);
  });

  it('rejects an unknown compare level', () => {
    const e = caught(() => mergeDefaults({ timelineCompareLevel: 'bytes' as unknown as 'text' })) as TreepackError;
    expect(e).toBeInstanceOf(TreepackError);
    expect(e.message).toMatch(/Expected 'text' or 'token' for timelineCompareLevel/);
  });
});

// Chat records through the real Qwen3 template.
const tools = (name: string) => [
  { type: 'function', function: { name, description: `${name} things`, parameters: { type: 'object', properties: {} } } },
];
const call = (name: string, args: string, id: string) => ({ id, type: 'function', function: { name, arguments: args } });

function chat(id: string, value: Record<string, unknown>): ChatRecord {
  return parseRecords({ id, episode: 'ep', group: 'g', ...value }, { file: 'c.jsonl', line: 1 })[0] as ChatRecord;
}

function chatTimelines(records: ChatRecord[], o: MergeOptions = {}): Timeline[] {
  return records.map((r) => timelineFromChat(r, encoder, mergeDefaults(o)).timeline);
}

const system = { role: 'system', content: 'You book flights.' };
const ask = { role: 'user', content: 'Find me a flight to Oslo.' };

describe('timeline merge on chat records (Qwen3 template)', () => {
  it('an unmerged timeline is exactly what ChatEncoder.encode produces', () => {
    const r = chat('r', {
      messages: [system, ask],
      tools: tools('search'),
      response: { role: 'assistant', content: null, tool_calls: [call('search', '{"to": "OSL"}', 'c1')] },
    });
    const s = timelineToSample(chatTimelines([r])[0]);
    const e = encoder.encode(r);
    expect(arr(s.tokens)).toEqual(arr(e.tokens));
    expect(arr(s.loss_mask)).toEqual(arr(e.loss_mask));
  });

  it('text compare merges request k into k+1 across the think-block drift; token compare does not', () => {
    const r0 = chat('ep/0', { messages: [system, ask], response: { role: 'assistant', content: 'Which date?' } });
    const r1 = chat('ep/1', {
      messages: [system, ask, { role: 'assistant', content: 'Which date?' }, { role: 'user', content: 'Friday.' }],
      response: { role: 'assistant', content: 'Done.' },
    });
    const ts = chatTimelines([r0, r1]);
    const text = mergeTimelines(ts);
    expect(text.samples.length).toBe(1);
    expect(text.report.driftedMessages).toBe(1);
    // Request 0's trainable tokens (with their empty think block) sit unchanged at the start of the merged sample.
    const s0 = encoder.encode(r0);
    const merged = text.samples[0];
    expect(arr(merged.tokens.subarray(0, s0.tokens.length))).toEqual(arr(s0.tokens));
    expect(arr(merged.loss_mask.subarray(0, s0.tokens.length))).toEqual(arr(s0.loss_mask));
    expect(encoder.tokenizer.decode(merged.tokens)).toContain('<think>\n\n</think>\n\nWhich date?<|im_end|>');
    expect(mergeTimelines(ts, { timelineCompareLevel: 'token' }).samples.length).toBe(2);
  });

  it('assistant turns that call different tools never compare equal (the AgentJet text-compare hazard)', () => {
    const lookup = { role: 'assistant', content: null, tool_calls: [call('get_user', '{"id": 1}', 'c1')] };
    const cancel = { role: 'assistant', content: null, tool_calls: [call('cancel', '{"id": 1}', 'c1')] };
    const r0 = chat('ep/0', { messages: [system, ask], response: cancel });
    const r1 = chat('ep/1', {
      messages: [system, ask, lookup, { role: 'tool', content: '{}', tool_call_id: 'c1' }],
      response: { role: 'assistant', content: 'OK.' },
    });
    const ts = chatTimelines([r0, r1]);
    // Both assistant turns have content null: AgentJet's text compare would call them equal.
    expect(ts[0].messages[2].calls).not.toBe(ts[1].messages[2].calls);
    expect(mergeTimelines(ts).samples.length).toBe(2);
    const same = chat('ep/1', {
      messages: [system, ask, cancel, { role: 'tool', content: '{}', tool_call_id: 'c1' }],
      response: { role: 'assistant', content: 'OK.' },
    });
    expect(mergeTimelines(chatTimelines([r0, same])).samples.length).toBe(1);
  });

  it('tool schema differences are ignored by default and separate timelines with ignoreTools off', () => {
    const r0 = chat('ep/0', { messages: [system, ask], tools: tools('search'), response: { role: 'assistant', content: 'Which date?' } });
    const r1 = chat('ep/1', {
      messages: [system, ask, { role: 'assistant', content: 'Which date?' }, { role: 'user', content: 'Friday.' }],
      tools: tools('book'),
      response: { role: 'assistant', content: 'Done.' },
    });
    expect(mergeTimelines(chatTimelines([r0, r1])).samples.length).toBe(1);
    const strict = { ignoreTools: false };
    expect(mergeTimelines(chatTimelines([r0, r1], strict), strict).samples.length).toBe(2);
    const r1same = chat('ep/1', {
      messages: [system, ask, { role: 'assistant', content: 'Which date?' }, { role: 'user', content: 'Friday.' }],
      tools: tools('search'),
      response: { role: 'assistant', content: 'Done.' },
    });
    expect(mergeTimelines(chatTimelines([r0, r1same], strict), strict).samples.length).toBe(1);
  });

  it('the engine’s token_ids win over the re-rendered response, with their logprobs', () => {
    const rendered = encoder.encode(chat('x', { messages: [ask], response: { role: 'assistant', content: 'Yes.' } }));
    const gen = [...rendered.loss_mask.keys()].filter((i) => rendered.loss_mask[i] === 1).map((i) => rendered.tokens[i]);
    const engine = [...gen.slice(0, 2), 9999, ...gen.slice(2)]; // one token the template would not produce
    const logprobs = engine.map((_, i) => -0.5 * (i + 1));
    const r = chat('x', { messages: [ask], response: { role: 'assistant', content: 'Yes.', token_ids: engine, logprobs } });
    const built = timelineFromChat(r, encoder, mergeDefaults());
    expect(built.drifted).toBe(true);
    const s = timelineToSample(built.timeline);
    const on = [...s.loss_mask.keys()].filter((i) => s.loss_mask[i] === 1);
    expect(on.map((i) => s.tokens[i])).toEqual(engine);
    expect(on.map((i) => s.rollout_logprobs![i])).toEqual(logprobs);
    expect(s.tokens.length).toBe(rendered.tokens.length + 1);
    // Same tokens as rendered: no drift, logprobs attached to the rendered tokens.
    const clean = timelineFromChat(
      chat('x', { messages: [ask], response: { role: 'assistant', content: 'Yes.', token_ids: gen, logprobs: gen.map(() => -1) } }),
      encoder,
      mergeDefaults(),
    );
    expect(clean.drifted).toBe(false);
    // With the fix off the engine's logprobs fit no trained token: a clear error naming the record and field.
    const e = caught(() => timelineFromChat(r, encoder, mergeDefaults({ fixRetokenizationDrift: false }))) as TreepackError;
    expect(e).toBeInstanceOf(TreepackError);
    expect(e.where).toMatchObject({ record: 'x', field: 'response.logprobs' });
    expect(e.message).toMatch(/fixRetokenizationDrift is off/);
  });
});

describe('bad input', () => {
  const where = { file: 'bad.jsonl', line: 3 };
  it('names the record and field', () => {
    const cases: [unknown, RegExp, string][] = [
      [{ id: 'r', messages: [{ content: 'hi' }], response: 'x' }, /role/, 'messages[0].role'],
      [
        { id: 'r', messages: [ask], response: { role: 'assistant', content: 'x', token_ids: [1, 2], logprobs: [-1] } },
        /expected 2 values/,
        'response.logprobs',
      ],
      [
        { id: 'r', messages: [ask], response: { role: 'assistant', content: 'x', token_ids: [1, -2] } },
        /token id/,
        'response.token_ids[1]',
      ],
      [{ id: 'r', tokens: [1, 2, 3], message_offsets: [0, 3] }, /offset in 1\.\.2/, 'message_offsets[1]'],
      [{ id: 'r', tokens: [1, 2, 3], message_offsets: [1] }, /starts at 0/, 'message_offsets[0]'],
      [{ id: 'r', tokens: [1, 2, 3], message_offsets: [0, 1], message_authors: ['llm', 'robot'] }, /one of llm/, 'message_authors[1]'],
      [{ id: 'r', tokens: [1, 2, 3], message_offsets: [0, 1], message_authors: ['llm'] }, /expected 2 values/, 'message_authors'],
      [{ id: 'r', tokens: [1, 2, 3], message_authors: ['llm'] }, /needs message_offsets/, 'message_authors'],
      // A trainable token outside an 'llm' message would be dropped when its timeline is absorbed.
      [
        { id: 'r', tokens: [1, 2, 3, 4], loss_mask: [0, 0, 1, 1], message_offsets: [0, 2], message_authors: ['user', 'user'] },
        /loss_mask\[2\] = 1\) but its author is "user"/,
        'message_authors[1]',
      ],
    ];
    for (const [value, re, field] of cases) {
      const e = caught(() => parseRecords(value, where)) as TreepackError;
      expect(e, JSON.stringify(value)).toBeInstanceOf(TreepackError);
      expect(e.message).toMatch(re);
      expect(e.where).toMatchObject({ file: 'bad.jsonl', line: 3, record: 'r', field });
    }
  });

  it('a tool message without a call id', () => {
    const r = chat('r', {
      messages: [ask, { role: 'assistant', content: null, tool_calls: [call('f', '{}', 'c1')] }, { role: 'tool', content: '{}' }],
      response: { role: 'assistant', content: 'ok' },
    });
    const e = caught(() => timelineFromChat(r, encoder, mergeDefaults())) as TreepackError;
    expect(e).toBeInstanceOf(TreepackError);
    expect(e.where).toMatchObject({ record: 'r', field: 'messages[2].tool_call_id' });
  });

  it('pre-tokenized samples: boundaries make a timeline, other per-token fields pass through', () => {
    const [s] = parseRecords(
      { id: 's', tokens: [5, 6, 7, 8], loss_mask: [0, 0, 1, 1], rollout_logprobs: [0, 0, -1, -2], message_offsets: [0, 2] },
      where,
    ) as Sample[];
    const t = timelineFromSample(s)!;
    expect(t.messages.map((m) => [m.author, arr(m.tokens)])).toEqual([
      ['env', [5, 6]],
      ['llm', [7, 8]],
    ]);
    const [o] = parseRecords({ id: 'o', tokens: [5, 6], message_offsets: [0], old_logprobs: [0, -1] }, where) as Sample[];
    expect(timelineFromSample(o)).toBeUndefined();
  });
});

describe('timeline snaps', () => {
  const snaps = (ts: Timeline[]) => mergeTimelines(ts, { detectTimelineSnap: true }).report.snaps;
  it('finds where each context broke and the sharing lost', () => {
    const s = sys(),
      u1 = user(1),
      u2 = user(2),
      u3 = user(3);
    const truncated = snaps([tl('e/0', [s, u1, context(1), u2, sampled(2)]), tl('e/1', [s, u2, context(2), u3, sampled(3)])]);
    // e/0 = 3+2+2+2+2 tokens; sharing stops after the system prompt, so 8 tokens of it are lost.
    expect(truncated).toEqual([{ episode: 'e', record: 'e/1', previous: 'e/0', message: 1, kind: 'truncation', lostTokens: 8 }]);
    const newSystem = snaps([
      tl('e/0', [s, u1, sampled(1)]),
      tl('e/1', [msg('initialization', 'sys2', [1, 2]), u1, context(1), u2, sampled(2)]),
    ]);
    expect(newSystem).toMatchObject([{ message: 0, kind: 'system', lostTokens: 7 }]);
    const summary = snaps([tl('e/0', [s, u1, context(1), u2, sampled(2)]), tl('e/1', [s, msg('user', 'summary', [50]), u3, sampled(3)])]);
    expect(summary).toMatchObject([{ message: 1, kind: 'rewrite', lostTokens: 8 }]);
    const rollback = snaps([tl('e/0', [s, u1, context(1), u2, sampled(2)]), tl('e/1', [s, u1])]);
    expect(rollback).toMatchObject([{ message: 2, kind: 'rollback', lostTokens: 6 }]);
    // Extending any earlier context (a retry from an earlier state) is not a snap.
    expect(
      snaps([
        tl('e/0', [s, u1, sampled(1)]),
        tl('e/1', [s, u1, context(1), u2, sampled(2)]),
        tl('e/2', [s, u1, context(1), u3, sampled(3)]),
      ]),
    ).toEqual([]);
  });
});

/**
 * Random episodes: conversation trees with retries, truncations, several agents and episodes sharing a system
 * prompt. Tokens and logprobs are functions of the message text, and a sampled message renders with an extra
 * leading token (drift) unless `drift` is off, like Qwen3's think block.
 */
function randomTimelines(seed: number, drift: boolean): Timeline[] {
  const r = rng(seed);
  const pick = (n: number) => Math.floor(r() * n);
  const hash = (s: string) => [...s].reduce((h, c) => (Math.imul(h, 31) + c.charCodeAt(0)) >>> 0, 7);
  const render = (text: string) => [
    1 + (hash(text) % 50),
    1 + (hash(text + '#') % 50),
    ...Array.from({ length: hash(text) % 3 }, (_, i) => 60 + i),
  ];
  const m = (author: Author, text: string): TimelineMessage => msg(author, text, render(text));
  const gen = (text: string): TimelineMessage => {
    const tokens = drift ? [99, ...render(text)] : render(text);
    return msg(
      'llm',
      text,
      tokens,
      tokens.map((t) => -((t * 7) % 13) / 4),
    );
  };
  const out: Timeline[] = [];
  const episodes = 1 + pick(3);
  for (let e = 0; e < episodes; e++) {
    for (const agent of pick(2) ? ['a', 'b'] : ['a']) {
      const states: TimelineMessage[][] = [[m('initialization', 'system'), m('user', `task ${pick(2)}`)]];
      const requests = 1 + pick(12);
      for (let k = 0; k < requests; k++) {
        let state = r() < 0.7 ? states[states.length - 1] : states[pick(states.length)];
        if (r() < 0.1 && state.length > 3) state = [state[0], ...state.slice(2 + pick(state.length - 2))]; // truncation
        const answer = `answer ${pick(4)}`;
        out.push({
          id: `e${e}-${agent}/${k}`,
          group: 'g',
          episode: `e${e}`,
          agent,
          tools: '',
          messages: [...state, gen(answer)],
          source: { file: 'p', line: k },
        });
        states.push([...state, m('env', answer), m('user', `reply ${pick(5)}`)]);
      }
    }
  }
  return out;
}

/**
 * The oracle's drift repair: within an episode and agent, a context copy of a message sampled after the same
 * earlier messages (same text path) takes the sampled tokens.
 */
function repaired(ts: Timeline[]): Timeline[] {
  const path = (t: Timeline, i: number) =>
    `${t.episode}|${t.agent}|${t.messages
      .slice(0, i + 1)
      .map((m) => m.text)
      .join('\u0000')}`;
  const sampledAt = new Map<string, TimelineMessage>();
  for (const t of ts) t.messages.forEach((m, i) => m.author === 'llm' && sampledAt.set(path(t, i), m));
  return ts.map((t) => ({
    ...t,
    messages: t.messages.map((m, i) => {
      const s = m.author === 'llm' ? undefined : sampledAt.get(path(t, i));
      return s ? { ...m, tokens: s.tokens, lossMask: new Uint8Array(s.tokens.length) } : m;
    }),
  }));
}

/** Every trainable (episode, context, token, logprob) occurrence. */
function triples(samples: Sample[]): string[] {
  const out: string[] = [];
  for (const s of samples)
    for (let p = 0; p < s.tokens.length; p++)
      if (s.loss_mask[p]) out.push(`${s.episode}|${Array.from(s.tokens.subarray(0, p + 1)).join(',')}|${s.rollout_logprobs![p]}`);
  return out.sort();
}

function counts(xs: string[]): Map<string, number> {
  const m = new Map<string, number>();
  for (const x of xs) m.set(x, (m.get(x) ?? 0) + 1);
  return m;
}

function forestOf(seqs: ArrayLike<number>[]) {
  const f = packForest(csr(seqs));
  return { input_ids: arr(f.input_ids), parent: arr(f.parent), position_ids: arr(f.position_ids), subtree_end: arr(f.subtree_end) };
}

describe('snap summary', () => {
  it('counts every snap but keeps only the first ones', () => {
    const snap = (i: number, kind: Snap['kind']): Snap => ({
      episode: 'e',
      record: `r${i}`,
      previous: `r${i - 1}`,
      message: 1,
      kind,
      lostTokens: i,
    });
    const summary = emptySnapSummary();
    addSnaps(summary, [snap(1, 'truncation'), snap(2, 'rewrite'), snap(3, 'truncation')], 2);
    addSnaps(summary, [snap(4, 'system')], 2);
    expect(summary.count).toBe(4);
    expect(summary.lostTokens).toBe(1 + 2 + 3 + 4);
    expect(summary.kinds).toEqual({ truncation: 2, rewrite: 1, system: 1 });
    expect(summary.first.map((s) => s.record)).toEqual(['r1', 'r2']);
  });
});

describe('timeline merge properties', () => {
  for (const level of ['text', 'token'] as const) {
    for (const drift of [false, true]) {
      it(`${level} compare${drift ? ', drifted rendering' : ''}: no trainable token lost or altered, same forest, order-independent`, () => {
        for (let seed = 1; seed <= 60; seed++) {
          const ts = randomTimelines(seed, drift);
          const { samples, report } = mergeTimelines(ts, { timelineCompareLevel: level });
          expect(report.timelines).toBe(report.samples + report.absorbed);
          expect(report.apart).toBe(0);
          // Token compare never rewrites tokens; text compare equals the inputs once drift is repaired.
          const inputs = (level === 'text' ? repaired(ts) : ts).map((t) => timelineToSample(t));
          // Every input occurrence is trained in the output, and nothing more often than in the inputs (merging
          // trains an occurrence shared by an absorbed timeline and its absorber once).
          const want = counts(triples(inputs));
          const got = counts(triples(samples));
          expect([...got.keys()].sort()).toEqual([...want.keys()].sort());
          for (const [k, c] of got) expect(c, k).toBeLessThanOrEqual(want.get(k)!);
          expect(forestOf(samples.map((s) => s.tokens))).toEqual(forestOf(inputs.map((s) => s.tokens)));
          const byId = new Map(ts.map((t) => [t.id, t]));
          for (const s of samples) {
            for (const id of s.merged_from ?? []) {
              const t = byId.get(id)!;
              expect([t.episode, t.agent]).toEqual([byId.get(s.id)!.episode, byId.get(s.id)!.agent]);
            }
          }
          const again = mergeTimelines(shuffled(ts, seed * 7).items, { timelineCompareLevel: level });
          expect(again).toEqual({ samples, report });
          expect(toSequences(again.samples).tokens).toEqual(toSequences(samples).tokens);
        }
      });
    }
  }
});

describe('timeline merge in the pipeline', () => {
  it('accounts for every record, and --no-merge packs each record as ChatEncoder encodes it', async () => {
    const { Readable } = await import('node:stream');
    const { generateJsonl } = await import('../bench/dataset.js');
    const { packRecords } = await import('../src/packer/index.js');
    const text = generateJsonl({ groups: 1, seed: 3, minTurns: 3, maxTurns: 8 });
    const run = async (merge: MergeOptions | false) => {
      const packed = packRecords(Readable.from([text]), {
        tokenizer: 'qwen3',
        advantages: 'none',
        merge: merge === false ? false : { ...merge, detectTimelineSnap: true },
      });
      const samples: Sample[] = [];
      for await (const mb of packed) samples.push(...mb.samples);
      return { stats: packed.report(), samples };
    };
    const merged = await run({});
    const plain = await run(false);
    expect(merged.stats.read.records).toBe(merged.stats.samples + merged.stats.absorbed);
    expect(merged.stats.absorbed).toBeGreaterThan(0);
    expect(merged.stats.snaps.count).toBeGreaterThan(0); // the generator truncates every 4th episode
    expect(merged.stats.snaps.kinds).toEqual({ truncation: merged.stats.snaps.count });
    expect(merged.stats.snaps.first.every((s) => s.kind === 'truncation')).toBe(true);
    expect(merged.stats.packedTokens).toBeLessThanOrEqual(plain.stats.packedTokens);
    expect(plain.stats.samples).toBe(plain.stats.read.records);
    const records = text
      .trim()
      .split('\n')
      .flatMap((l, i) => parseRecords(JSON.parse(l), { file: '<stream>', line: i + 1 }, { defaultId: `line-${i + 1}` })) as ChatRecord[];
    expect(plain.samples.map((s) => arr(s.tokens))).toEqual(records.map((r) => arr(encoder.encode(r).tokens)));
    expect(plain.samples.map((s) => arr(s.loss_mask))).toEqual(records.map((r) => arr(encoder.encode(r).loss_mask)));
  }, 60_000);
});
