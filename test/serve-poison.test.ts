/**
 * Poison records: one tenant's call the packer cannot pack never takes other tenants' work down with it.
 * - A `developer` message (current OpenAI SDKs send it) is rendered as the served template renders it (Qwen3's
 *   drops the role, so it goes to the engine and the log as system); an unknown role, `content: 5`,
 *   `tool_calls: 5`, a remote image or a tool message without its call id is a 400 naming the message and field,
 *   neither forwarded nor recorded; the step holding the developer call trains every group (defect N1).
 * - An episode whose records fail only at pack time (a turn marker in its text) is quarantined: the rest of the
 *   step, its own group included, is trained; it is listed in `/v1/feed`, counted, logged once and exported by
 *   `GET /v1/quarantine` with records that reproduce the error; a restart before the ack quarantines it no twice.
 *   With an engine returning token ids it fails while its records are made: quarantined with its recorded calls.
 *   The same on the shared pool (Redis), listed by every gateway and counted by the one that packed it.
 * - A tool-call turn recorded without a `content` key reads back to slime with `content: ""` (defect N2).
 */
import { describe, expect, it } from 'vitest';
import { parseSafetensors } from '../src/io/safetensors.js';
import { packRecords } from '../src/packer/index.js';
import { Service } from '../src/serve/service.js';
import { loadTokenizer } from '../src/tokenize/tokenizer.js';
import { inProcessServices } from './helpers/in-process.js';
import { redisAvailable, startRedis } from './helpers/redis.js';
import { tempDir } from './helpers/serve.js';
import { startStubEngine } from './helpers/stub-engine.js';

const post = (url: string, body: unknown) =>
  fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });
const call = (base: string, group: string, episode: string, messages: unknown[], extra: Record<string, unknown> = {}) =>
  post(`${base}/groups/${group}/episodes/${episode}/v1/chat/completions`, { model: 'm', messages, ...extra });
const user = (content: unknown) => ({ role: 'user', content });

/** The next micro-batch's id and sequence ids (undefined: none within `wait` seconds). */
async function pull(base: string, wait = 5): Promise<{ id: string; seqs: string[] } | undefined> {
  const res = await fetch(`${base}/v1/batches/next?wait=${wait}`);
  if (res.status === 204) return undefined;
  expect(res.status, await res.clone().text()).toBe(200);
  const meta = parseSafetensors(new Uint8Array(await res.arrayBuffer())).metadata;
  return { id: res.headers.get('x-treepack-id')!, seqs: JSON.parse(meta.sequence_ids) as string[] };
}

const episodesOf = (seqs: string[]) => [...new Set(seqs.map((s) => s.slice(0, s.lastIndexOf('/'))))].sort();
/** a user turn the template renders, with the turn marker the packer splits turns at: it fails at pack time only */
const MARKER = user('see <|im_start|>system\nthis');

type FeedBody = {
  quarantined: number;
  quarantine: { step: number; episode: string; group: string; reason: string }[];
  pack_errors: string[];
};
type QuarantineBody = {
  quarantined: { episode: string; group: string; step: number; reason: string; records: Record<string, unknown>[] }[];
};

const services = inProcessServices('tp-poison-');

describe('poison records', { timeout: 60_000 }, () => {
  it('N1: developer rendered as the template renders it, unrenderable messages refused with the field; the step trains every group', async () => {
    const { base } = await services.start({ groupsPerStep: 2 });
    const stub = services.stub!;
    expect((await call(base, 'other', 'other', [user('hi')])).status).toBe(200);
    const dev = await call(base, 'dev', 'dev', [{ role: 'developer', content: 'Be brief.' }, user('hi')]);
    expect(dev.status, await dev.clone().text()).toBe(200);
    // Qwen3's template drops a developer turn: the engine and the log get it as the system turn it means.
    const lines = (await (await fetch(`${base}/v1/episodes/dev/records`)).text()).trim().split('\n');
    const records = lines.map((l) => JSON.parse(l) as { requests: { messages: { role: string }[] }[] });
    expect.soft(records[0].requests[0].messages.map((m) => m.role)).toEqual(['system', 'user']);

    const refused: [unknown[], RegExp][] = [
      [
        [{ role: 'narrator', content: 'x' }, user('hi')],
        /field "messages\[0\]\.role": expected system, developer, user, assistant or tool .*got "narrator"/,
      ],
      [[user(5)], /field "messages\[0\]\.content": expected a string, null or an array of content parts, got 5/],
      [
        [user('q'), { role: 'assistant', content: null, tool_calls: 5 }, user('and?')],
        /field "messages\[1\]\.tool_calls": expected an array of tool calls/,
      ],
      [
        [user([{ type: 'image_url', image_url: { url: 'http://x/y.png' } }])],
        /field "messages\[0\]\.content\[0\]\.image_url\.url": expected a base64 data URL .*never fetches/,
      ],
      [[user('q'), { role: 'tool', content: '42' }], /field "messages\[1\]\.tool_call_id": a tool message needs the id/],
    ];
    const before = stub.calls;
    for (const [messages, why] of refused) {
      const r = await call(base, 'bad', 'bad', messages);
      expect.soft(r.status).toBe(400);
      expect.soft(((await r.json()) as { error?: { message: string } }).error?.message).toMatch(why);
    }
    expect.soft(stub.calls, 'a refused call is not forwarded').toBe(before);
    expect.soft((await fetch(`${base}/v1/episodes/bad`)).status, 'nor recorded').toBe(404);

    for (const e of ['other', 'dev']) expect((await post(`${base}/v1/episodes/${e}/finish`, { reward: 1 })).status).toBe(200);
    const mb = await pull(base);
    expect(mb, 'the step (other, dev) is trained').toBeDefined();
    expect(episodesOf(mb!.seqs)).toEqual(['dev', 'other']);
    const feed = (await (await fetch(`${base}/v1/feed`)).json()) as FeedBody;
    expect(feed).toMatchObject({ pack_errors: [], quarantined: 0 });
  });

  it('a record failing only at pack time is quarantined: the rest of the step trains, listed, counted, logged, exported, once', async () => {
    const warnings: string[] = [];
    const dataDir = tempDir('tp-poison-q-');
    const opts = { groupSize: 2, groupsPerStep: 2, dataDir, warn: (m: string) => warnings.push(m) };
    const { base, svc } = await services.start(opts);
    for (const [g, e, messages] of [
      ['A', 'a0', [user('a')]],
      ['A', 'a1', [user('b')]],
      ['B', 'b0', [user('c')]],
      ['B', 'b1', [MARKER]],
    ] as const) {
      expect((await call(base, g, e, [...messages])).status).toBe(200);
      expect((await post(`${base}/v1/episodes/${e}/finish`, { reward: 1 })).status).toBe(200);
    }
    const mb = await pull(base);
    expect(mb, 'the step is trained without the poison episode').toBeDefined();
    expect(episodesOf(mb!.seqs)).toEqual(['a0', 'a1', 'b0']);
    expect(await pull(base, 0)).toBeUndefined();
    const feed = (await (await fetch(`${base}/v1/feed`)).json()) as FeedBody;
    expect(feed.pack_errors).toEqual([]);
    expect(feed.quarantined).toBe(1);
    expect(feed.quarantine).toEqual([{ step: 0, episode: 'b1', group: 'B', reason: expect.stringMatching(/turn marker/) }]);
    expect(await (await fetch(`${base}/metrics`)).text()).toMatch(/^treepack_quarantined_total 1$/m);
    expect(warnings.filter((w) => w.includes('quarantined'))).toEqual([
      expect.stringMatching(/step 0: episode "b1" \(group "B"\) quarantined.*turn marker/),
    ]);
    // The export's records are what `treepack pack` reads: packing them alone gives the same error.
    const exported = ((await (await fetch(`${base}/v1/quarantine`)).json()) as QuarantineBody).quarantined;
    expect(exported.map((q) => [q.episode, q.group, q.step])).toEqual([['b1', 'B', 0]]);
    await expect(async () => {
      for await (const _ of packRecords(exported[0].records, { tokenizer: 'qwen3' }));
    }).rejects.toThrow(exported[0].reason.slice(exported[0].reason.indexOf('message text')));

    // A restart before the ack packs the step again (at its ack): the episode is quarantined no twice.
    await services.stop(svc);
    const again = await services.start(opts);
    expect((await post(`${again.base}/v1/batches/${mb!.id}/ack`, {})).status).toBe(200);
    expect(warnings.filter((w) => w.includes('quarantined'))).toHaveLength(1);
    expect(((await (await fetch(`${again.base}/v1/quarantine`)).json()) as QuarantineBody).quarantined).toHaveLength(1);
    expect(((await (await fetch(`${again.base}/v1/feed`)).json()) as FeedBody).quarantined).toBe(1);
    expect((await fetch(`${again.base}/v1/quarantine?limit=0`)).status).toBe(400);
  });

  it("with the engine's token ids, the poison fails while its records are made: quarantined with its recorded calls", async () => {
    const engine = await startStubEngine('ok', { tokenizer: await loadTokenizer('qwen3') });
    const dataDir = tempDir('tp-poison-ids-');
    const svc = await Service.create({
      engineUrl: engine.url,
      dataDir,
      port: 0,
      groupsPerStep: 2,
      warn: () => {},
      packer: { tokenizer: 'qwen3' },
    });
    try {
      const base = await svc.listen();
      for (const [e, messages] of [
        ['ok', [{ role: 'developer', content: 'Be brief.' }, user('a')]],
        ['bad', [MARKER]],
      ] as const) {
        expect((await call(base, e, e, [...messages])).status).toBe(200);
        expect((await post(`${base}/v1/episodes/${e}/finish`, { reward: 1 })).status).toBe(200);
      }
      const mb = await pull(base);
      expect(mb, 'the step is trained without the poison episode').toBeDefined();
      expect(episodesOf(mb!.seqs)).toEqual(['ok']);
      const [q] = ((await (await fetch(`${base}/v1/quarantine`)).json()) as { quarantined: Record<string, unknown>[] }).quarantined;
      expect(q).toMatchObject({ episode: 'bad', step: 0, reason: expect.stringMatching(/turn marker/) });
      expect(q.records).toBeUndefined();
      expect(q.calls).toEqual([expect.objectContaining({ kind: 'chat', request: { messages: [MARKER] } })]);
      // the developer turn went to the engine as system: its prompt is the template's, trained as matched
      const feed = (await (await fetch(`${base}/v1/feed`)).json()) as { prompts: Record<string, number> };
      expect(feed.prompts).toMatchObject({ promptMatched: 1, promptDrifted: 0 });
    } finally {
      await svc.close();
      await engine.close();
    }
  });

  it('N2: a tool-call turn sent without a content key reads back to slime with content ""', async () => {
    const { base } = await services.start({});
    const tools = [
      { type: 'function', function: { name: 'search', parameters: { type: 'object', properties: { query: { type: 'string' } } } } },
    ];
    const named = { tools, tool_choice: { type: 'function', function: { name: 'search' } } };
    const first = (await (await call(base, 't', 't', [user('find it')], named)).json()) as {
      choices: { message: Record<string, unknown> }[];
    };
    const { content: _, ...turn } = first.choices[0].message; // the openai idiom model_dump(exclude_none=True)
    expect(turn.tool_calls).toBeDefined();
    const messages = [user('find it'), turn, { role: 'tool', tool_call_id: (turn.tool_calls as { id: string }[])[0].id, content: '42' }];
    expect((await call(base, 't', 't', messages, { tools })).status).toBe(200);
    expect((await post(`${base}/v1/episodes/t/finish`, { reward: 1 })).status).toBe(200);
    const read = (await (await post(`${base}/get_rollout_data`, {})).json()) as {
      data: { data: { messages: Record<string, unknown>[] }[] };
    };
    const back = read.data.data[0].messages;
    expect(back[1]).toMatchObject({ role: 'assistant', content: '' });
    for (const m of back) expect(typeof m.content, JSON.stringify(m)).toBe('string');
  });
});

const onRedis = redisAvailable('serve-poison') ? describe : describe.skip;

onRedis('poison records on the shared pool', { timeout: 60_000 }, () => {
  it('quarantined once by the gateway that packs the step, listed by both, the rest trained', async () => {
    const redis = await startRedis();
    const gateways: Service[] = [];
    try {
      const warnings: string[] = [];
      const opts = { groupSize: 2, groupsPerStep: 2, redis: redis.url, warn: (m: string) => warnings.push(m) };
      const [A, B] = [await services.start(opts), await services.start(opts)].map((g) => (gateways.push(g.svc), g.base)) as [
        string,
        string,
      ];
      const dev = [{ role: 'developer', content: 'Be brief.' }, user('b')];
      for (const [base, g, e, messages] of [
        [A, 'A', 'a0', [user('a')]],
        [B, 'A', 'a1', dev],
        [A, 'B', 'b0', [user('c')]],
        [B, 'B', 'b1', [MARKER]],
      ] as const) {
        expect((await call(base, g, e, [...messages])).status).toBe(200);
        expect((await post(`${base}/v1/episodes/${e}/finish`, { reward: 1 })).status).toBe(200);
      }
      const mb = await pull(A);
      expect(mb).toBeDefined();
      expect(episodesOf(mb!.seqs)).toEqual(['a0', 'a1', 'b0']);
      expect((await post(`${B}/v1/batches/${mb!.id}/ack`, {})).status).toBe(200);
      for (const base of [A, B]) {
        const feed = (await (await fetch(`${base}/v1/feed`)).json()) as FeedBody;
        expect(feed.quarantined).toBe(1);
        expect(feed.quarantine).toEqual([{ step: 0, episode: 'b1', group: 'B', reason: expect.stringMatching(/turn marker/) }]);
        const q = ((await (await fetch(`${base}/v1/quarantine`)).json()) as QuarantineBody).quarantined;
        expect(q.map((x) => x.episode)).toEqual(['b1']);
        expect(JSON.stringify(q[0].records)).toContain('<|im_start|>system\\nthis');
      }
      expect(warnings.filter((w) => w.includes('quarantined'))).toHaveLength(1);
    } finally {
      for (const g of gateways) await services.stop(g); // before Redis stops under them
      await redis.stop();
    }
  });
});
