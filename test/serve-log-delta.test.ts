/**
 * A call is logged as what it adds to its episode's previous call of the same agent (Pool.logged): agents
 * re-send their whole context, so whole calls would make the log grow with the square of an episode's length.
 * Every call still reads back exactly as sent: live, after a restart (replay), and through compaction; multi-agent
 * episodes, retries with another context and tools that change keep their own requests; the shared pool holds an
 * episode the same way. A call that names an earlier call the log does not hold refuses to start, naming it.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { appendFileSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { compactEvents } from '../src/serve/compact.js';
import { scan, type LogEvent } from '../src/serve/log.js';
import { Pool, type RecordedCall } from '../src/serve/pool.js';
import { episodeFromJson, episodeJson } from '../src/serve/redis-pool.js';
import { Service } from '../src/serve/service.js';
import { tempDir } from './helpers/serve.js';
import { startStubEngine, type StubEngine } from './helpers/stub-engine.js';

type Msg = Record<string, unknown>;
const TOOLS = [
  {
    type: 'function',
    function: { name: 'lookup', description: 'find a booking', parameters: { type: 'object', properties: { id: { type: 'string' } } } },
  },
];
const OTHER_TOOLS = [{ type: 'function', function: { name: 'cancel', parameters: { type: 'object', properties: {} } } }];
const SYSTEM: Msg = { role: 'system', content: 'You are the airline agent. '.repeat(40) };

/** What each call sent, in order: [episode, agent, body]. */
function traffic(): [string, string | undefined, Record<string, unknown>][] {
  const out: [string, string | undefined, Record<string, unknown>][] = [];
  let ctx: Msg[] = [SYSTEM, { role: 'user', content: 'I want to change my flight.' }];
  for (let k = 0; k < 6; k++) {
    out.push(['e1', undefined, { model: 'm', messages: ctx, tools: TOOLS }]);
    ctx = [
      ...ctx,
      {
        role: 'assistant',
        content: `answer ${k}`,
        tool_calls: [{ id: `t${k}`, type: 'function', function: { name: 'lookup', arguments: `{"id":"${k}"}` } }],
      },
      { role: 'tool', tool_call_id: `t${k}`, content: `booking ${k} `.repeat(30) },
    ];
  }
  // a retry with a temporary context: shares only the system prompt and the first user message
  out.push(['e1', undefined, { model: 'm', messages: [ctx[0], ctx[1], { role: 'user', content: 'summarise so far' }], tools: TOOLS }]);
  // the main line again, now with other tools, then without any
  out.push(['e1', undefined, { model: 'm', messages: [...ctx, { role: 'user', content: 'go on' }], tools: OTHER_TOOLS }]);
  out.push(['e1', undefined, { model: 'm', messages: [...ctx, { role: 'user', content: 'go on' }, { role: 'user', content: 'and?' }] }]);
  // a second agent in the same episode, with its own context, interleaved
  out.push([
    'e1',
    'critic',
    {
      model: 'm',
      messages: [
        { role: 'system', content: 'You judge.' },
        { role: 'user', content: 'judge 1' },
      ],
    },
  ]);
  out.push([
    'e1',
    'critic',
    {
      model: 'm',
      messages: [
        { role: 'system', content: 'You judge.' },
        { role: 'user', content: 'judge 1' },
        { role: 'user', content: 'judge 2' },
      ],
    },
  ]);
  // a message whose keys come in another order still matches
  out.push([
    'e1',
    undefined,
    {
      model: 'm',
      messages: [
        { content: SYSTEM.content, role: 'system' },
        { role: 'user', content: 'new task' },
      ],
    },
  ]);
  // another episode starts whole
  out.push(['e2', undefined, { model: 'm', messages: [SYSTEM, { role: 'user', content: 'hello' }], tools: TOOLS }]);
  return out;
}

const asSent = (body: Record<string, unknown>) => ({ messages: body.messages, ...(body.tools ? { tools: body.tools } : {}) });
/** A call's request, keys in one order (a matched message may be the earlier call's object). */
const canon = (v: unknown): unknown =>
  Array.isArray(v)
    ? v.map(canon)
    : v && typeof v === 'object'
      ? Object.fromEntries(
          Object.keys(v)
            .sort()
            .map((k) => [k, canon((v as Msg)[k])]),
        )
      : v;

describe('the log holds what each call adds', { timeout: 30_000 }, () => {
  let stub: StubEngine;
  let dir: string;
  const sent = traffic();

  beforeAll(async () => {
    stub = await startStubEngine();
    dir = tempDir('tp-serve-delta-');
    const svc = await Service.create({ packer: { tokenizer: 'qwen3' }, engineUrl: stub.url, dataDir: dir, port: 0 });
    const base = await svc.listen();
    for (const [episode, agent, body] of sent) {
      const r = await fetch(`${base}/v1/chat/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', 'x-treepack-episode': episode, ...(agent && { 'x-treepack-agent': agent }) },
        body: JSON.stringify(body),
      });
      expect(r.status).toBe(200);
    }
    await svc.close();
  });
  afterAll(async () => {
    await stub?.close();
  });

  const logEvents = () => {
    const events: LogEvent[] = [];
    scan(readFileSync(join(dir, 'events.jsonl')), dir, (e) => events.push(e));
    return events;
  };

  it('logs a continued call as its new messages, naming the call it continues', () => {
    const calls = logEvents()
      .filter((e) => e.type === 'call')
      .map((e) => (e.call as RecordedCall).request as Record<string, unknown>);
    expect(calls.map((r) => [r.keep ?? null, r.sameTools ?? null, (r.messages as unknown[]).length, r.tools ? 1 : 0])).toEqual([
      [null, null, 2, 1], // first call: whole
      [2, true, 2, 0],
      [4, true, 2, 0],
      [6, true, 2, 0],
      [8, true, 2, 0],
      [10, true, 2, 0],
      [2, true, 1, 0], // the retry keeps the system prompt and first user message
      [2, null, 13, 1], // back on the main line after the retry: continues the retry's 2 shared messages; new tools logged
      [15, null, 1, 0], // no tools at all
      [null, null, 2, 0], // the critic's first call: nothing of its own before it
      [2, null, 1, 0],
      [1, null, 1, 0], // the reordered system message matches
      [null, null, 2, 1], // e2 starts whole
    ]);
    const whole = sent.reduce((t, [, , body]) => t + JSON.stringify(asSent(body)).length, 0);
    const logged = readFileSync(join(dir, 'events.jsonl')).length;
    expect(logged).toBeLessThan(whole / 2);
  });

  it('reads every call back as sent: after a restart, and through compaction', async () => {
    const restarted = await Service.create({ packer: { tokenizer: 'qwen3' }, engineUrl: stub.url, dataDir: dir, port: 0 });
    try {
      const got = [...restarted.pool.episodes.get('e1')!.calls, ...restarted.pool.episodes.get('e2')!.calls].map((c) => canon(c.request));
      expect(got).toEqual(sent.map(([, , body]) => canon(asSent(body))));
      // The shared pool holds an episode the same way (src/serve/redis-pool.ts).
      const ep = restarted.pool.episodes.get('e1')!;
      const json = episodeJson(ep);
      expect(json.length).toBeLessThan(JSON.stringify(ep.calls).length / 2);
      expect(episodeFromJson(json).calls.map((c) => canon(c.request))).toEqual(ep.calls.map((c) => canon(c.request)));
    } finally {
      await restarted.close();
    }
    const pool = new Pool({ groupSize: 1 });
    for (const e of compactEvents(logEvents(), 1)) pool.apply(e);
    expect(pool.episodes.get('e1')!.calls.map((c) => canon(c.request))).toEqual(
      sent.filter(([ep]) => ep === 'e1').map(([, , body]) => canon(asSent(body))),
    );
  });

  it('a call continuing one the log does not hold: the service refuses to start, naming it', async () => {
    const broken = tempDir('tp-serve-delta-broken-');
    const lines = readFileSync(join(dir, 'events.jsonl'), 'utf8').split('\n').filter(Boolean);
    writeFileSync(join(broken, 'events.jsonl'), lines[0] + '\n'); // the first call only
    const second = JSON.parse(lines[1]) as { call: { request: { from: string } } };
    second.call.request.from = 'no-such-call';
    appendFileSync(join(broken, 'events.jsonl'), JSON.stringify(second) + '\n');
    await expect(Service.create({ packer: { tokenizer: 'qwen3' }, engineUrl: stub.url, dataDir: broken, port: 0 })).rejects.toThrow(
      /events\.jsonl:2, field "call\.request\.from": damaged log: call .* of episode "e1" continues call "no-such-call"/,
    );
  });
});
