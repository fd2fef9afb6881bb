/**
 * The agent APIs beside chat completions: the OpenAI Responses API driven by the official `openai` Python
 * package (`client.responses.create`, streaming and not), the Anthropic Messages API by the official `anthropic`
 * Python package (`client.messages.create`, `.stream` and `.count_tokens`), and `n > 1` on chat completions, all
 * against the stub engine answering as vLLM does (token ids, logprobs, tool calls, n choices). Each episode is
 * written here, by hand, as the chat episode it is (the messages a chat client would have sent, the engine's own
 * ids and logprobs as the responses), and what the trainer feed hands out for the recorded episode must be byte
 * for byte what `treepack pack` writes for that chat episode. Each token count must be the prompt the stub engine
 * then received for the call.
 */
import { execFile, spawnSync } from 'node:child_process';
import { readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { pythonEnv } from '../scripts/python-env.mjs';
import { parseSafetensors } from '../src/io/safetensors.js';
import { Service } from '../src/serve/service.js';
import { loadTokenizer } from '../src/tokenize/tokenizer.js';
import { cli } from './helpers/cli.js';
import { redisAvailable, startRedis } from './helpers/redis.js';
import { tempDir } from './helpers/serve.js';
import { startStubEngine, type StubEngine } from './helpers/stub-engine.js';

type Obj = Record<string, unknown>;

/**
 * The project's Python (scripts/python-env.mjs) when it imports `modules`, else why not: the suite that needs
 * them is skipped, naming the reason, or under TREEPACK_REQUIRE_TORCH=1 (CI installs
 * python/requirements-torch.txt) runs and fails with it.
 */
function sdkPython(modules: string[]): { python?: string; reason?: string; skip: boolean } {
  const env = pythonEnv();
  const probe = env.python ? spawnSyncPython(env.python, `import ${modules.join(', ')}`) : env.reason;
  if (!probe) return { python: env.python!, skip: false };
  const reason = `${env.python ?? 'no Python'} cannot import ${modules.join(', ')} (pip install -r python/requirements-torch.txt): ${probe}`;
  return { reason, skip: process.env.TREEPACK_REQUIRE_TORCH !== '1' };
}

function required(py: { python?: string; reason?: string }): string {
  if (!py.python) throw new Error(`TREEPACK_REQUIRE_TORCH=1 but ${py.reason}`);
  return py.python;
}

function spawnSyncPython(python: string, code: string): string | undefined {
  const r = spawnSync(python, ['-c', code], { encoding: 'utf8', timeout: 60_000 });
  return r.status === 0 ? undefined : (r.stderr || String(r.error)).trim().split('\n').pop();
}

const openaiPy = sdkPython(['openai']);
const anthropicPy = sdkPython(['anthropic']);

const SEARCH_SCHEMA = { type: 'object', properties: { query: { type: 'string' } }, required: ['query'] };
/** The search tool as chat completions spell it: what both translations must produce. */
const CHAT_TOOLS = [{ type: 'function', function: { name: 'search', description: 'search the web', parameters: SEARCH_SCHEMA } }];

let engine: StubEngine;
let svc: Service;
let base: string;
let dir: string;

beforeAll(async () => {
  const tokenizer = await loadTokenizer('qwen3');
  engine = await startStubEngine('ok', { tokenizer, record: true });
  dir = tempDir('tp-agent-apis-');
  svc = await Service.create({
    engineUrl: engine.url,
    dataDir: dir,
    port: 0,
    groupSize: 1,
    policy: { kind: 'windowed-fifo', window: 8 },
    packer: { tokenizer: 'qwen3' },
  });
  base = await svc.listen();
}, 120_000);

afterAll(async () => {
  await svc?.close();
  await engine?.close();
});

async function runPython(python: string, script: string, ...args: string[]): Promise<Obj> {
  const r = await promisify(execFile)(python, ['-c', script, ...args], { encoding: 'utf8', timeout: 120_000 });
  expect(r.stderr).not.toMatch(/Traceback/);
  return JSON.parse(r.stdout.trim().split('\n').pop()!) as Obj;
}

/** A chat response as the episode's JSONL holds it: the message and what the engine generated for it. */
function response(message: Obj, produced: { token_ids: number[]; logprobs: number[] }): Obj {
  return { ...message, token_ids: produced.token_ids, logprobs: produced.logprobs };
}

/**
 * The three-call search episode both API tests play (a forced tool call, its result, two replies) as a chat client
 * would have sent it: the messages of each call and the episode as a JSONL record with the engine's outputs.
 */
function searchEpisode(
  episode: string,
  group: string,
  c0: number,
  produced: { token_ids: number[]; logprobs: number[] }[],
): { messages: Obj[][]; reference: Obj } {
  const m1 = [
    { role: 'system', content: 'You are an agent.' },
    { role: 'user', content: 'Find the capital of France.' },
  ];
  const toolTurn = {
    role: 'assistant',
    content: null,
    tool_calls: [{ id: `call_${c0}`, type: 'function', function: { name: 'search', arguments: `{"query": "q ${c0}"}` } }],
  };
  const m2 = [...m1, toolTurn, { role: 'tool', tool_call_id: `call_${c0}`, content: 'Paris' }];
  const m3 = [...m2, { role: 'assistant', content: `reply ${c0 + 1}` }, { role: 'user', content: 'Thanks.' }];
  const reference = {
    episode_id: episode,
    task_id: group,
    meta: { reward: 1 },
    requests: [
      { messages: m1, response: response(toolTurn, produced[0]), tools: CHAT_TOOLS },
      { messages: m2, response: response({ role: 'assistant', content: `reply ${c0 + 1}` }, produced[1]), tools: CHAT_TOOLS },
      { messages: m3, response: response({ role: 'assistant', content: `reply ${c0 + 2}` }, produced[2]), tools: CHAT_TOOLS },
    ],
  };
  return { messages: [m1, m2, m3], reference };
}

/**
 * The two-turn thinking episode (a question, a reasoned reply, "More.", a second reasoned reply) reached the engine as
 * chat messages and packs as the chat episode whose assistant turns carry `reasoning_content`.
 */
async function thinkingPackedAsChat(episode: string, c0: number, produced: { token_ids: number[]; logprobs: number[] }[]): Promise<void> {
  const turn = (k: number) => ({ role: 'assistant', content: `reply ${c0 + k}`, reasoning_content: `thought ${c0 + k}` });
  const m1 = [{ role: 'user', content: 'Why?' }];
  const m2 = [...m1, turn(0), { role: 'user', content: 'More.' }];
  expect(engine.requests.slice(-2).map((r) => r.messages)).toEqual([m1, m2]);
  const reference = {
    episode_id: episode,
    task_id: episode,
    meta: { reward: 1 },
    requests: [
      { messages: m1, response: response(turn(0), produced[0]) },
      { messages: m2, response: response(turn(1), produced[1]) },
    ],
  };
  await packedEqualsReference(episode, episode, reference);
}

/**
 * Finishes `episode`, pulls the step its group forms, and checks it is what `treepack pack` writes for
 * `reference` (the episode as chat JSONL); returns the micro-batch's sequences.
 */
async function packedEqualsReference(episode: string, group: string, reference: Obj): Promise<{ tokens: number[]; mask: number[] }[]> {
  const fin = await fetch(`${base}/v1/episodes/${episode}/finish`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ reward: 1 }),
  });
  expect(fin.status).toBe(200);
  const res = await fetch(`${base}/v1/batches/next?rank=0&dp=1&wait=30`);
  expect(res.status).toBe(200);
  const entry = JSON.parse(res.headers.get('x-treepack-entry')!) as { id: string; groups: string[] };
  expect(entry.groups).toEqual([group]);
  const bytes = new Uint8Array(await res.arrayBuffer());
  const input = join(dir, `${episode}.jsonl`);
  writeFileSync(input, JSON.stringify(reference) + '\n');
  const out = join(dir, `${episode}-packed`);
  const r = cli(['pack', input, '--out', out, '--timeline-compare-level', 'token', '--tokenizer', 'qwen3', '--quiet']);
  expect(r.stderr).toBe('');
  const manifest = JSON.parse(readFileSync(join(out, 'manifest.json'), 'utf8')) as { micro_batches: { file: string }[] };
  expect(manifest.micro_batches).toHaveLength(1);
  expect(Buffer.from(bytes).equals(readFileSync(join(out, manifest.micro_batches[0].file)))).toBe(true);
  expect((await fetch(`${base}/v1/batches/${entry.id}/ack`, { method: 'POST' })).status).toBe(200);
  const t = parseSafetensors(bytes).tensors;
  const ids = t.get('input_ids')!.data as Int32Array,
    pos = t.get('seq_positions')!.data as Int32Array,
    off = t.get('seq_offsets')!.data as Int32Array;
  const mask = t.get('loss_mask')!.data as Uint8Array;
  const seqs = [];
  for (let i = 0; i + 1 < off.length; i++) {
    const idx = Array.from(pos.subarray(off[i], off[i + 1]));
    seqs.push({ tokens: idx.map((p) => ids[p]), mask: Array.from(mask.subarray(off[i], off[i + 1])) });
  }
  return seqs;
}

describe.skipIf(openaiPy.skip)(
  `the Responses API through the openai Python package${openaiPy.reason ? ` (skipped: ${openaiPy.reason})` : ''}`,
  () => {
    it(
      'tool call, function output, streamed text, a last turn: recorded and packed as the chat episode',
      { timeout: 180_000 },
      async () => {
        const script = `
import json, sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1], api_key="none")
tools = [{"type": "function", "name": "search", "description": "search the web", "parameters": ${JSON.stringify(SEARCH_SCHEMA)}}]
dump = lambda items: [i.model_dump(exclude_none=True) for i in items]
r1 = client.responses.create(model="stub", instructions="You are an agent.", input="Find the capital of France.", tools=tools, tool_choice={"type": "function", "name": "search"}, max_output_tokens=32)
call = [o for o in r1.output if o.type == "function_call"][0]
items = [{"role": "user", "content": "Find the capital of France."}] + dump(r1.output) + [{"type": "function_call_output", "call_id": call.call_id, "output": "Paris"}]
events, text, final = [], "", None
for ev in client.responses.create(model="stub", instructions="You are an agent.", input=items, tools=tools, max_output_tokens=32, stream=True):
    events.append(ev.type)
    if ev.type == "response.output_text.delta": text += ev.delta
    if ev.type == "response.completed": final = ev.response
items += dump(final.output) + [{"role": "user", "content": "Thanks."}]
r3 = client.responses.create(model="stub", instructions="You are an agent.", input=items, tools=tools, max_output_tokens=32, include=["message.output_text.logprobs"])
print(json.dumps({"r1": r1.model_dump(), "events": events, "text": text, "final": final.model_dump(), "r3": r3.model_dump(), "r3_text": r3.output_text}))
`;
        const before = engine.produced.length;
        const c0 = engine.calls; // the stub numbers its calls: call_<n>, "q <n>", "reply <n>"
        const out = (await runPython(required(openaiPy), script, `${base}/groups/resp-task/episodes/resp-a/v1`)) as {
          r1: Obj;
          events: string[];
          text: string;
          final: Obj;
          r3: Obj;
          r3_text: string;
        };
        const produced = engine.produced.slice(before);
        expect(produced).toHaveLength(3);

        // What the client saw: a function call with the engine's arguments text, a streamed answer, a last one.
        const fc = (out.r1.output as Obj[])[0];
        expect(out.r1).toMatchObject({ object: 'response', status: 'completed' });
        expect(fc).toMatchObject({ type: 'function_call', name: 'search', arguments: `{"query": "q ${c0}"}`, call_id: `call_${c0}` });
        expect(out.events[0]).toBe('response.created');
        expect(out.events.at(-1)).toBe('response.completed');
        expect(out.events).toEqual(
          expect.arrayContaining([
            'response.output_item.added',
            'response.content_part.added',
            'response.output_text.delta',
            'response.output_text.done',
            'response.output_item.done',
          ]),
        );
        expect(out.text).toBe(`reply ${c0 + 1}`);
        expect(out.r3_text).toBe(`reply ${c0 + 2}`);
        // logprobs asked for (include): the engine's, token by token of the text
        const lp = ((out.r3.output as Obj[])[0].content as Obj[])[0].logprobs as { logprob: number }[];
        expect(lp.map((x) => x.logprob)).toEqual(produced[2].logprobs);
        expect(out.r3.usage).toMatchObject({
          input_tokens: produced[2].prompt_token_ids.length,
          output_tokens: produced[2].token_ids.length,
        });

        // The episode as a chat client would have sent it; the engine got those messages and tools, as chat completions.
        const { messages, reference } = searchEpisode('resp-a', 'resp-task', c0, produced);
        expect(engine.requests.slice(-3).map((r) => [r.messages, r.tools])).toEqual(messages.map((m) => [m, CHAT_TOOLS]));
        const seqs = await packedEqualsReference('resp-a', 'resp-task', reference);
        // one timeline: each call continues the one before, token for token
        expect(seqs).toHaveLength(1);
      },
    );
  },
);

describe.skipIf(anthropicPy.skip)(
  `the Messages API through the anthropic Python package${anthropicPy.reason ? ` (skipped: ${anthropicPy.reason})` : ''}`,
  () => {
    it(
      'tool_use, tool_result, a streamed answer, a last turn, with a scoped key: recorded and packed as the chat episode',
      { timeout: 180_000 },
      async () => {
        const key = (await (
          await fetch(`${base}/v1/episodes`, {
            method: 'POST',
            headers: { 'content-type': 'application/json' },
            body: JSON.stringify({ episode_id: 'msg-a', group: 'msg-task' }),
          })
        ).json()) as { api_key: string };
        const script = `
import json, sys
import anthropic
client = anthropic.Anthropic(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0)
tools = [{"name": "search", "description": "search the web", "input_schema": ${JSON.stringify(SEARCH_SCHEMA)}}]
msgs = [{"role": "user", "content": "Find the capital of France."}]
m1 = client.messages.create(model="stub", max_tokens=32, system="You are an agent.", messages=msgs, tools=tools, tool_choice={"type": "tool", "name": "search"})
use = [b for b in m1.content if b.type == "tool_use"][0]
msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Paris"}]}]
with client.messages.stream(model="stub", max_tokens=32, system="You are an agent.", messages=msgs, tools=tools) as s:
    text = "".join(s.text_stream)
    final = s.get_final_message()
msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]}, {"role": "user", "content": "Thanks."}]
m3 = client.messages.create(model="stub", max_tokens=32, system=[{"type": "text", "text": "You are an agent."}], messages=msgs, tools=tools)
try:
    client.messages.create(model="stub", max_tokens=32, messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    refused = None
except anthropic.BadRequestError as e:
    refused = {"status": e.status_code, "body": e.body}
print(json.dumps({"m1": m1.model_dump(), "text": text, "final": final.model_dump(), "m3": m3.model_dump(), "refused": refused}))
`;
        const before = engine.produced.length;
        const c0 = engine.calls; // the stub numbers its calls: call_<n>, "q <n>", "reply <n>"
        const out = (await runPython(required(anthropicPy), script, base, key.api_key)) as {
          m1: Obj;
          text: string;
          final: Obj;
          m3: Obj;
          refused: { status: number; body: Obj };
        };
        const produced = engine.produced.slice(before);
        expect(produced).toHaveLength(3);
        expect(out.m1).toMatchObject({
          type: 'message',
          role: 'assistant',
          stop_reason: 'tool_use',
          content: [{ type: 'tool_use', id: `call_${c0}`, name: 'search', input: { query: `q ${c0}` } }],
        });
        expect(out.m1.usage).toMatchObject({
          input_tokens: produced[0].prompt_token_ids.length,
          output_tokens: produced[0].token_ids.length,
        });
        expect(out.text).toBe(`reply ${c0 + 1}`);
        expect(out.final).toMatchObject({ stop_reason: 'end_turn', content: [{ type: 'text', text: `reply ${c0 + 1}` }] });
        expect(out.m3).toMatchObject({ stop_reason: 'end_turn', content: [{ type: 'text', text: `reply ${c0 + 2}` }] });
        // refused in the Messages API's error shape, naming the block
        expect(out.refused.status).toBe(400);
        expect(out.refused.body).toMatchObject({
          type: 'error',
          error: { type: 'invalid_request_error', message: expect.stringMatching(/messages\[0\]\.content\[0\]\.type.*"image"/) },
        });

        // The tool_use input comes back as an object: the engine's own arguments text is what was generated and sent.
        const { messages, reference } = searchEpisode('msg-a', 'msg-task', c0, produced);
        expect(engine.requests.slice(-3).map((r) => [r.messages, r.tools])).toEqual(messages.map((m) => [m, CHAT_TOOLS]));
        expect(await packedEqualsReference('msg-a', 'msg-task', reference)).toHaveLength(1);
      },
    );
  },
);

/** The prompt token ids of each call `/v1/episodes/{id}` recorded: the prompt as the engine tokenized it. */
async function recordedPrompts(episode: string): Promise<number[][]> {
  const rec = (await (await fetch(`${base}/v1/episodes/${episode}`)).json()) as { calls: { output: { promptTokenIds: number[] } }[] };
  return rec.calls.map((c) => c.output.promptTokenIds);
}

const ANTHROPIC_HEADERS = { 'content-type': 'application/json', 'anthropic-version': '2023-06-01' };
const countAt = (url: string, body: unknown, headers: Record<string, string> = {}) =>
  fetch(url, { method: 'POST', headers: { ...ANTHROPIC_HEADERS, 'x-api-key': 'none', ...headers }, body: JSON.stringify(body) }).then(
    async (r) => ({ status: r.status, body: (await r.json()) as Obj }),
  );

describe.skipIf(anthropicPy.skip)(
  `count_tokens through the anthropic Python package${anthropicPy.reason ? ` (skipped: ${anthropicPy.reason})` : ''}`,
  () => {
    it(
      'each count is the prompt the engine then gets for the call: system, tools, a tool_use/tool_result round, more turns',
      { timeout: 180_000 },
      async () => {
        const key = (await (
          await fetch(`${base}/v1/episodes`, {
            method: 'POST',
            headers: { 'content-type': 'application/json' },
            body: JSON.stringify({ episode_id: 'ct-a', group: 'ct-task' }),
          })
        ).json()) as { api_key: string };
        const script = `
import json, sys
import anthropic
client = anthropic.Anthropic(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0)
tools = [{"name": "search", "description": "search the web", "input_schema": ${JSON.stringify(SEARCH_SCHEMA)}},
         {"name": "lookup", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "year": {"type": "integer"}}}}]
system = "You are an agent."
msgs = [{"role": "user", "content": "Find the capital of France."}]
counts, usage = [], []
def turn(**kw):
    counts.append(client.messages.count_tokens(model="stub", system=system, messages=msgs, tools=tools, **kw).input_tokens)
    m = client.messages.create(model="stub", max_tokens=32, system=system, messages=msgs, tools=tools, **kw)
    usage.append(m.usage.input_tokens)
    msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
    return m
m1 = turn(tool_choice={"type": "tool", "name": "search"})
use = [b for b in m1.content if b.type == "tool_use"][0]
msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "Paris"}]}, {"type": "text", "text": "Is that right?"}]})
turn()
msgs.append({"role": "user", "content": "Thanks. And Germany?"})
turn(tool_choice={"type": "auto"})
msgs.append({"role": "user", "content": [{"type": "text", "text": "One more:"}, {"type": "text", "text": "Italy?"}]})
turn()
print(json.dumps({"counts": counts, "usage": usage}))
`;
        const before = engine.produced.length;
        const c0 = engine.calls;
        // Before the first call: a count opens nothing and asks the engine nothing.
        const first = await countAt(
          `${base}/groups/ct-task/episodes/ct-a/v1/messages/count_tokens`,
          { model: 'stub', messages: [{ role: 'user', content: 'Find the capital of France.' }] },
          { 'x-api-key': key.api_key },
        );
        expect(first.status).toBe(200);
        expect(engine.calls).toBe(c0);
        expect((await fetch(`${base}/v1/episodes/ct-a`)).status).toBe(404);

        const out = (await runPython(required(anthropicPy), script, `${base}/groups/ct-task/episodes/ct-a`, key.api_key)) as {
          counts: number[];
          usage: number[];
        };
        // four counts and four calls: only the calls reached the engine
        expect(engine.calls).toBe(c0 + 4);
        const produced = engine.produced.slice(before);
        expect(produced).toHaveLength(4);
        const recorded = await recordedPrompts('ct-a');
        expect(recorded).toHaveLength(4);
        // The references: the prompt the stub engine rendered (transformers' way, through jinja) for each call, as it
        // was recorded, and as its usage reported it.
        expect(recorded).toEqual(produced.map((p) => p.prompt_token_ids));
        expect(out.counts).toEqual(produced.map((p) => p.prompt_token_ids.length));
        expect(out.usage).toEqual(out.counts);
        // the conversation grew each turn: the counts measure it, not a constant
        expect(new Set(out.counts).size).toBe(4);
        // a tool_use sent back is counted with the arguments text the engine generated (the episode's record)
        expect(engine.requests.at(-3)!.messages).toContainEqual({
          role: 'assistant',
          content: null,
          tool_calls: [{ id: `call_${c0}`, type: 'function', function: { name: 'search', arguments: `{"query": "q ${c0}"}` } }],
        });
      },
    );
  },
);

describe('count_tokens, plain', () => {
  const BODY = {
    model: 'stub',
    system: 'Be brief.',
    messages: [{ role: 'user', content: 'Hello there.' }],
    tools: [{ name: 'search', input_schema: SEARCH_SCHEMA }],
  };

  it('is no call: nothing recorded, the engine not asked, the episode opened by its first call as ever', async () => {
    const c0 = engine.calls;
    const depth = svc.pool.depth();
    const counts = [];
    for (const url of [
      `${base}/episodes/ct-b/v1/messages/count_tokens`,
      `${base}/groups/ct-g/episodes/ct-b/v1/messages/count_tokens`,
      `${base}/v1/messages/count_tokens`,
    ]) {
      const r = await countAt(url, BODY, url.startsWith(`${base}/v1/`) ? { 'x-treepack-episode': 'ct-b' } : {});
      expect(r.status).toBe(200);
      expect(Object.keys(r.body)).toEqual(['input_tokens']);
      counts.push(r.body.input_tokens);
    }
    // no episode at all: counted the same (only a recorded tool call's arguments text needs the episode)
    counts.push((await countAt(`${base}/v1/messages/count_tokens`, BODY)).body.input_tokens);
    expect(new Set(counts).size).toBe(1);
    expect(engine.calls).toBe(c0);
    expect(svc.pool.episodes.has('ct-b')).toBe(false);
    expect(svc.pool.groups.has('ct-g')).toBe(false);
    expect(svc.pool.depth()).toEqual(depth);
    expect((await fetch(`${base}/v1/episodes/ct-b`)).status).toBe(404);
    // The first call opens the episode in its group, and its prompt is the count.
    const r = await fetch(`${base}/groups/ct-g/episodes/ct-b/v1/messages`, {
      method: 'POST',
      headers: { ...ANTHROPIC_HEADERS, 'x-api-key': 'none' },
      body: JSON.stringify({ ...BODY, max_tokens: 8 }),
    });
    expect(r.status).toBe(200);
    expect(((await r.json()) as { usage: Obj }).usage.input_tokens).toBe(counts[0]);
    const ep = (await (await fetch(`${base}/v1/episodes/ct-b`)).json()) as {
      group: string;
      calls: { output: { promptTokenIds: number[] } }[];
    };
    expect(ep.group).toBe('ct-g');
    expect(ep.calls.map((c) => c.output.promptTokenIds.length)).toEqual([counts[0]]);
    expect(engine.calls).toBe(c0 + 1);
  });

  it("counts with the engine's chat_template_kwargs; refuses what a call refuses, and what it cannot count, naming the field", async () => {
    const url = `${base}/episodes/ct-c/v1/messages/count_tokens`;
    // Qwen3 without thinking: the generation prompt closes an empty think block. The reference renders the template
    // (jinja, as transformers and the stub do) with the variable set.
    const tok = await loadTokenizer('qwen3');
    const chat = [
      { role: 'system', content: 'Be brief.' },
      { role: 'user', content: 'Hello there.' },
    ];
    const off = tok.encode(
      tok.chatTemplate.render({
        ...tok.templateVars,
        messages: chat,
        tools: [{ type: 'function', function: { name: 'search', parameters: SEARCH_SCHEMA } }],
        add_generation_prompt: true,
        enable_thinking: false,
      }),
    ).length;
    const plain = (await countAt(url, BODY)).body.input_tokens as number;
    const r = await countAt(url, { ...BODY, chat_template_kwargs: { enable_thinking: false } });
    expect(r).toEqual({ status: 200, body: { input_tokens: off } });
    expect(off).toBeGreaterThan(plain);

    const c0 = engine.calls;
    const refused: [Obj, RegExp][] = [
      [{ tools: [{ type: 'web_search_20250305', name: 'web_search' }] }, /field "tools\[0\]\.type": server and Anthropic-defined tools/],
      [
        { messages: [{ role: 'user', content: [{ type: 'image', source: { type: 'url', url: 'http://x/y.png' } }] }] },
        /field "messages\[0\]\.content\[0\]\.type": user content of type "image"/,
      ],
      [{ thinking: { type: 'enabled', budget_tokens: 1024 } }, /field "thinking"/],
      [{ mcp_servers: [{}] }, /field "mcp_servers"/],
      [{ messages: [] }, /field "messages": expected a non-empty list/],
      [{ tool_choice: { type: 'tool' } }, /field "tool_choice"/],
      [{ chat_template: '{{ messages }}' }, /field "chat_template": the count renders the service's --tokenizer chat template/],
      [{ continue_final_message: true }, /field "continue_final_message"/],
      [{ chat_template_kwargs: 'no' }, /field "chat_template_kwargs": expected an object/],
    ];
    for (const [body, why] of refused) {
      const res = await countAt(url, { ...BODY, ...body });
      expect(res.status, JSON.stringify(body)).toBe(400);
      expect(res.body).toEqual({ type: 'error', error: { type: 'invalid_request_error', message: expect.stringMatching(why) } });
    }
    expect(await countAt(url, [1])).toMatchObject({
      status: 400,
      body: { type: 'error', error: { message: expect.stringMatching(/request body: expected a JSON object/) } },
    });
    expect(engine.calls).toBe(c0);
    expect((await fetch(`${base}/v1/episodes/ct-c`)).status).toBe(404);
  });

  it('a scoped key counts in its own episode only, as its calls, x-api-key or bearer', async () => {
    const key = (await (
      await fetch(`${base}/v1/episodes`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ episode_id: 'ct-own', group: 'ct-own-g' }),
      })
    ).json()) as { api_key: string };
    const own = (await countAt(`${base}/v1/messages/count_tokens`, BODY)).body.input_tokens;
    for (const headers of [{ 'x-api-key': key.api_key }, { authorization: `Bearer ${key.api_key}` }] as Record<string, string>[]) {
      for (const url of [
        `${base}/v1/messages/count_tokens`,
        `${base}/episodes/ct-own/v1/messages/count_tokens`,
        `${base}/groups/ct-own-g/episodes/ct-own/v1/messages/count_tokens`,
      ]) {
        expect(await countAt(url, BODY, headers)).toEqual({ status: 200, body: { input_tokens: own } });
      }
      const elsewhere: [string, Record<string, string>, RegExp][] = [
        [`${base}/episodes/ct-victim/v1/messages/count_tokens`, {}, /opens episode "ct-own" only: not episode "ct-victim"/],
        [`${base}/v1/messages/count_tokens`, { 'x-treepack-episode': 'ct-victim' }, /not episode "ct-victim"/],
        [`${base}/groups/other-g/episodes/ct-own/v1/messages/count_tokens`, {}, /its group is "ct-own-g", not "other-g"/],
      ];
      for (const [url, h, why] of elsewhere) {
        expect(await countAt(url, BODY, { ...headers, ...h })).toEqual({
          status: 403,
          body: { type: 'error', error: { type: 'permission_error', message: expect.stringMatching(why) } },
        });
      }
    }
    expect(svc.pool.episodes.has('ct-own')).toBe(false);
  });
});

const redisRun = redisAvailable('serve-agent-apis count_tokens on Redis') ? describe : describe.skip;

redisRun('count_tokens on the shared pool', () => {
  it('claims no episode in Redis (a call does)', { timeout: 60_000 }, async () => {
    const redis = await startRedis();
    const shared = await Service.create({
      engineUrl: engine.url,
      dataDir: tempDir('tp-agent-apis-redis-'),
      port: 0,
      redis: redis.url,
      packer: { tokenizer: 'qwen3' },
    });
    const client = new Redis(redis.url);
    try {
      const b = await shared.listen();
      const body = { model: 'stub', messages: [{ role: 'user', content: 'hi' }] };
      const counted = await countAt(`${b}/episodes/ct-r/v1/messages/count_tokens`, body);
      expect(counted.status).toBe(200);
      expect(await client.keys('*ep:ct-r')).toEqual([]);
      const r = await fetch(`${b}/episodes/ct-r/v1/messages`, {
        method: 'POST',
        headers: { ...ANTHROPIC_HEADERS, 'x-api-key': 'none' },
        body: JSON.stringify({ ...body, max_tokens: 8 }),
      });
      expect(r.status).toBe(200);
      expect(((await r.json()) as { usage: Obj }).usage.input_tokens).toBe(counted.body.input_tokens);
      expect(await client.keys('*ep:ct-r')).toHaveLength(1);
    } finally {
      client.disconnect();
      await shared.close();
      await redis.stop();
    }
  });
});

describe('n > 1 on chat completions', () => {
  it('records each choice as a sibling branch of the call, streamed or not', { timeout: 120_000 }, async () => {
    const url = `${base}/groups/n-task/episodes/n-a/v1/chat/completions`;
    const post = (body: Obj) => fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });
    const before = engine.produced.length;
    const m1 = [{ role: 'user', content: 'Name a colour.' }];
    const r1 = (await (await post({ model: 'stub', messages: m1, n: 3, max_tokens: 8 })).json()) as {
      choices: { index: number; message: Obj }[];
    };
    expect(r1.choices.map((c) => [c.index, c.message.content])).toEqual(
      [0, 1, 2].map((j) => [j, j ? `reply ${engine.calls - 1}.${j}` : `reply ${engine.calls - 1}`]),
    );
    const first = r1.choices[0].message.content as string;
    const m2 = [...m1, { role: 'assistant', content: first }, { role: 'user', content: 'Another.' }];
    const s = await (await post({ model: 'stub', messages: m2, n: 2, max_tokens: 8, stream: true })).text();
    const texts = ['', ''];
    for (const line of s.split('\n')) {
      if (!line.startsWith('data: {')) continue;
      for (const c of (JSON.parse(line.slice(6)) as { choices: { index: number; delta: { content?: string } }[] }).choices)
        texts[c.index] += c.delta.content ?? '';
    }
    expect(s.trim().endsWith('data: [DONE]')).toBe(true);
    const produced = engine.produced.slice(before);
    expect(produced).toHaveLength(5);
    const n = engine.calls - 1;
    expect(texts).toEqual([`reply ${n}`, `reply ${n}.1`]);
    const reference = {
      episode_id: 'n-a',
      task_id: 'n-task',
      meta: { reward: 1 },
      requests: [
        ...[0, 1, 2].map((j) => ({ messages: m1, response: response(r1.choices[j].message, produced[j]) })),
        ...[0, 1].map((j) => ({ messages: m2, response: response({ role: 'assistant', content: texts[j] }, produced[3 + j]) })),
      ],
    };
    const seqs = await packedEqualsReference('n-a', 'n-task', reference);
    // Branches, not copies: choice 0 of the first call is continued by the second call's choices (two branches),
    // and choices 1 and 2 of the first call branch off its prompt; every branch is its own sequence.
    expect(seqs).toHaveLength(4);
    const prompt = produced[0].prompt_token_ids;
    for (const q of seqs) expect(q.tokens.slice(0, prompt.length)).toEqual(prompt);
  });

  it('keeps the siblings through a restart, and a retry answers all n from the record', { timeout: 120_000 }, async () => {
    const data = tempDir('tp-agent-apis-n-');
    const opts = { engineUrl: engine.url, dataDir: data, port: 0, packer: { tokenizer: 'qwen3' } };
    const call = (b: string) =>
      fetch(`${b}/episodes/n-b/v1/chat/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', 'idempotency-key': 'k' },
        body: JSON.stringify({ model: 'stub', messages: [{ role: 'user', content: 'hi' }], n: 3 }),
      });
    let s = await Service.create(opts);
    const first = (await (await call(await s.listen())).json()) as { choices: Obj[] };
    const before = (await (await fetch(`${s.app.listeningOrigin}/v1/episodes/n-b`)).json()) as { calls: Obj[] };
    expect(before.calls).toHaveLength(1);
    expect(before.calls[0].siblings).toHaveLength(2);
    await s.close();
    s = await Service.create(opts);
    const b = await s.listen();
    try {
      expect((await (await fetch(`${b}/v1/episodes/n-b`)).json()) as Obj).toEqual(before);
      const calls = engine.calls;
      const again = await call(b);
      expect(again.headers.get('x-treepack-replayed')).toBe('true');
      expect(((await again.json()) as { choices: Obj[] }).choices.map((c) => c.message)).toEqual(first.choices.map((c) => c.message));
      expect(engine.calls).toBe(calls);
    } finally {
      await s.close();
    }
  });
});

/** The events of an SSE body: [event name, data]. */
function events(text: string): [string, Obj][] {
  return text
    .split('\n\n')
    .filter((e) => e.trim() !== '')
    .map((e) => {
      const name = /^event: (.*)$/m.exec(e)?.[1] ?? '';
      return [name, JSON.parse(/^data: (.*)$/m.exec(e)![1]) as Obj];
    });
}

describe('streamed tool calls, as each API streams them', () => {
  const TOOL = { type: 'object', properties: { query: { type: 'string' } } };
  const post = (path: string, body: Obj, headers: Record<string, string> = {}) =>
    fetch(`${base}/episodes/stream-tools${path}`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', ...headers },
      body: JSON.stringify(body),
    });

  it('Responses: function_call item, argument deltas, completed; recorded with the engine ids; replayed alike', async () => {
    const c0 = engine.calls;
    const body = {
      model: 'stub',
      input: 'Search.',
      tools: [{ type: 'function', name: 'search', parameters: TOOL }],
      tool_choice: { type: 'function', name: 'search' },
      stream: true,
    };
    const text = await (await post('/v1/responses', body, { 'idempotency-key': 'rs' })).text();
    const evs = events(text);
    expect(evs.map(([n]) => n)).toEqual([
      'response.created',
      'response.in_progress',
      'response.output_item.added',
      'response.function_call_arguments.delta',
      'response.function_call_arguments.delta',
      'response.function_call_arguments.done',
      'response.output_item.done',
      'response.completed',
    ]);
    expect(evs.map(([, d]) => d.sequence_number)).toEqual(evs.map((_, i) => i));
    const args = `{"query": "q ${c0}"}`;
    expect(
      evs
        .filter(([n]) => n.endsWith('.delta'))
        .map(([, d]) => d.delta)
        .join(''),
    ).toBe(args);
    expect((evs.at(-1)![1].response as Obj).output).toEqual([
      { id: expect.any(String), type: 'function_call', status: 'completed', call_id: `call_${c0}`, name: 'search', arguments: args },
    ]);
    const rec = (await (await fetch(`${base}/v1/episodes/stream-tools`)).json()) as { calls: { output: Obj }[] };
    const produced = engine.produced.at(-1)!;
    expect(rec.calls.at(-1)!.output).toEqual({
      finishReason: 'stop',
      message: {
        role: 'assistant',
        content: null,
        tool_calls: [{ id: `call_${c0}`, type: 'function', function: { name: 'search', arguments: args } }],
      },
      promptTokenIds: produced.prompt_token_ids,
      tokenIds: produced.token_ids,
      logprobs: produced.logprobs,
    });
    // a retry: the same response from the record (its events in fewer deltas), the engine not called
    const again = await post('/v1/responses', body, { 'idempotency-key': 'rs' });
    expect(again.headers.get('x-treepack-replayed')).toBe('true');
    expect(events(await again.text()).at(-1)![1].response).toEqual(evs.at(-1)![1].response);
    expect(engine.calls).toBe(c0 + 1);
  });

  it('Messages: tool_use block, input_json_delta, stop_reason tool_use; recorded with the engine ids', async () => {
    const c0 = engine.calls;
    const body = {
      model: 'stub',
      max_tokens: 32,
      messages: [{ role: 'user', content: 'Search.' }],
      tools: [{ name: 'search', input_schema: TOOL }],
      tool_choice: { type: 'tool', name: 'search' },
      stream: true,
    };
    const evs = events(await (await post('/v1/messages', body, { 'x-api-key': 'unused', 'anthropic-version': '2023-06-01' })).text());
    expect(evs.map(([n]) => n)).toEqual([
      'message_start',
      'content_block_start',
      'content_block_delta',
      'content_block_delta',
      'content_block_stop',
      'message_delta',
      'message_stop',
    ]);
    for (const [n, d] of evs) expect(d.type).toBe(n);
    expect(evs[1][1].content_block).toEqual({ type: 'tool_use', id: `call_${c0}`, name: 'search', input: {} });
    const args = `{"query": "q ${c0}"}`;
    expect(
      evs
        .filter(([n]) => n === 'content_block_delta')
        .map(([, d]) => (d.delta as Obj).partial_json)
        .join(''),
    ).toBe(args);
    const produced = engine.produced.at(-1)!;
    expect(evs[5][1]).toEqual({
      type: 'message_delta',
      delta: { stop_reason: 'tool_use', stop_sequence: null },
      usage: { input_tokens: produced.prompt_token_ids.length, output_tokens: produced.token_ids.length },
    });
    const rec = (await (await fetch(`${base}/v1/episodes/stream-tools`)).json()) as { calls: { request: Obj; output: Obj }[] };
    expect(rec.calls.at(-1)!.output).toMatchObject({
      message: {
        role: 'assistant',
        content: null,
        tool_calls: [{ id: `call_${c0}`, type: 'function', function: { name: 'search', arguments: args } }],
      },
      tokenIds: produced.token_ids,
    });
    expect(rec.calls.at(-1)!.request).toEqual({
      messages: [{ role: 'user', content: 'Search.' }],
      tools: [{ type: 'function', function: { name: 'search', parameters: TOOL } }],
    });
  });
});

describe('reasoning, sent back as each API carries it', () => {
  const THINK = { chat_template_kwargs: { enable_thinking: true } }; // passed to the engine as it is
  const post = (episode: string, path: string, body: Obj, headers: Record<string, string> = {}) =>
    fetch(`${base}/groups/${episode}/episodes/${episode}${path}`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', ...headers },
      body: JSON.stringify(body),
    });

  it('Responses: a reasoning item, then the next turn: the reasoning_content of the assistant turn, packed as chat', async () => {
    const c0 = engine.calls;
    const before = engine.produced.length;
    const r1 = (await (await post('think-r', '/v1/responses', { model: 'stub', input: 'Why?', ...THINK })).json()) as { output: Obj[] };
    expect(r1.output.map((o) => o.type)).toEqual(['reasoning', 'message']);
    expect(r1.output[0]).toMatchObject({ content: [{ type: 'reasoning_text', text: `thought ${c0}` }] });
    const input = [{ role: 'user', content: 'Why?' }, ...r1.output, { role: 'user', content: 'More.' }];
    const evs = events(await (await post('think-r', '/v1/responses', { model: 'stub', input, stream: true, ...THINK })).text());
    expect(
      evs
        .filter(([n]) => n === 'response.reasoning_text.delta')
        .map(([, d]) => d.delta)
        .join(''),
    ).toBe(`thought ${c0 + 1}`);
    await thinkingPackedAsChat('think-r', c0, engine.produced.slice(before));
  });

  it('Messages: a thinking block, then the next turn: the reasoning_content of the assistant turn, packed as chat', async () => {
    const c0 = engine.calls;
    const before = engine.produced.length;
    const h = { 'x-api-key': 'unused', 'anthropic-version': '2023-06-01' };
    const m = (await (
      await post('think-m', '/v1/messages', { model: 'stub', max_tokens: 32, messages: [{ role: 'user', content: 'Why?' }], ...THINK }, h)
    ).json()) as { content: Obj[] };
    expect(m.content).toEqual([
      { type: 'thinking', thinking: `thought ${c0}`, signature: '' },
      { type: 'text', text: `reply ${c0}` },
    ]);
    const messages = [
      { role: 'user', content: 'Why?' },
      { role: 'assistant', content: m.content },
      { role: 'user', content: 'More.' },
    ];
    const evs = events(
      await (await post('think-m', '/v1/messages', { model: 'stub', max_tokens: 32, messages, stream: true, ...THINK }, h)).text(),
    );
    expect(evs.filter(([n]) => n === 'content_block_start').map(([, d]) => (d.content_block as Obj).type)).toEqual(['thinking', 'text']);
    await thinkingPackedAsChat('think-m', c0, engine.produced.slice(before));
  });
});

describe('what the translations refuse', () => {
  const post = (path: string, body: Obj, headers: Record<string, string> = {}) =>
    fetch(`${base}/episodes/refused${path}`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', ...headers },
      body: JSON.stringify(body),
    }).then(async (r) => ({ status: r.status, body: (await r.json()) as Obj }));

  it("names the field, in each API's error shape, and records nothing", async () => {
    const calls = engine.calls;
    const responses: [Obj, RegExp][] = [
      [{ input: 'hi', previous_response_id: 'resp_1' }, /field "previous_response_id": the gateway stores no responses/],
      [{ input: 'hi', tools: [{ type: 'web_search' }] }, /field "tools\[0\]\.type": built-in tools/],
      [
        { input: [{ role: 'user', content: [{ type: 'input_image', image_url: 'http://x/y.png' }] }] },
        /field "input\[0\]\.content\[0\]\.type": content of type "input_image"/,
      ],
      [{ input: [{ type: 'item_reference', id: 'msg_1' }] }, /field "input\[0\]\.type": item references/],
      [{ input: 'hi', include: ['reasoning.encrypted_content'] }, /field "include\[0\]"/],
      [{ input: 'hi', n: 2 }, /field "n"/],
    ];
    for (const [body, why] of responses) {
      const r = await post('/v1/responses', { model: 'stub', ...body });
      expect(r.status).toBe(400);
      expect((r.body.error as Obj).message).toMatch(why);
    }
    const messages: [Obj, RegExp][] = [
      [
        { messages: [{ role: 'user', content: 'hi' }], tools: [{ type: 'web_search_20250305', name: 'web_search' }] },
        /field "tools\[0\]\.type": server and Anthropic-defined tools/,
      ],
      [{ messages: [{ role: 'user', content: 'hi' }], thinking: { type: 'enabled', budget_tokens: 1024 } }, /field "thinking"/],
      [{ messages: [{ role: 'user', content: [{ type: 'document', source: {} }] }] }, /field "messages\[0\]\.content\[0\]\.type"/],
      [{ messages: [{ role: 'user', content: 'hi' }], mcp_servers: [{}] }, /field "mcp_servers"/],
    ];
    for (const [body, why] of messages) {
      const r = await post(
        '/v1/messages',
        { model: 'stub', max_tokens: 8, ...body },
        { 'x-api-key': 'none', 'anthropic-version': '2023-06-01' },
      );
      expect(r.status).toBe(400);
      expect(r.body).toMatchObject({ type: 'error', error: { type: 'invalid_request_error', message: expect.stringMatching(why) } });
    }
    expect(engine.calls).toBe(calls);
    expect((await fetch(`${base}/v1/episodes/refused`)).status).toBe(404);
  });

  it('a scoped key opens its own episode only, through x-api-key too', async () => {
    const key = (await (
      await fetch(`${base}/v1/episodes`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ episode_id: 'own' }),
      })
    ).json()) as { api_key: string };
    const r = await post(
      '/v1/messages',
      { model: 'stub', max_tokens: 8, messages: [{ role: 'user', content: 'hi' }] },
      { 'x-api-key': key.api_key },
    );
    expect(r.status).toBe(403);
    expect(r.body).toMatchObject({
      type: 'error',
      error: { type: 'permission_error', message: expect.stringMatching(/opens episode "own" only/) },
    });
  });

  it('a retried Responses call with its Idempotency-Key is answered as recorded, once', async () => {
    const url = `${base}/episodes/idem/v1/responses`;
    const send = () =>
      fetch(url, {
        method: 'POST',
        headers: { 'content-type': 'application/json', 'idempotency-key': 'k1' },
        body: JSON.stringify({ model: 'stub', input: 'hi' }),
      });
    const a = await send();
    const b = await send();
    expect(b.headers.get('x-treepack-replayed')).toBe('true');
    const [ja, jb] = [(await a.json()) as Obj, (await b.json()) as Obj];
    expect(jb.id).toBe(ja.id);
    expect(jb.output).toEqual(ja.output);
    expect(((await (await fetch(`${base}/v1/episodes/idem`)).json()) as { calls: unknown[] }).calls).toHaveLength(1);
  });
});
