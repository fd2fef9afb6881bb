/**
 * The recording gateway against a real engine on loopback (a tiny random-weight transformers model serving
 * token ids and logprobs), driven by the official `openai` npm client as the agent: multi-turn, tool calls,
 * streaming, a retry with temporary context, two agents, a legacy completion. What the gateway records equals
 * what the engine produced, token for token; the trainer feed's micro-batch holds every call's tokens with its
 * logprobs, and equals `treepack pack` on the same episodes written as JSONL.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import OpenAI from 'openai';
import { parseSafetensors } from '../src/io/safetensors.js';
import { Service } from '../src/serve/service.js';
import { cli } from './helpers/cli.js';
import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import { enginePython, ROOT, startEngine, tempDir, type Engine } from './helpers/serve.js';

const python = enginePython('test/serve-gateway.test.ts');

const TOOLS = [
  {
    type: 'function' as const,
    function: {
      name: 'search',
      description: 'search the web',
      parameters: { type: 'object', properties: { query: { type: 'string' } }, required: ['query'] },
    },
  },
];

type Msg = OpenAI.Chat.Completions.ChatCompletionMessageParam;

describe.skipIf(!python)('recording gateway on a real engine', () => {
  let engine: Engine;
  let svc: Service;
  let base: string;
  let dir: string;

  beforeAll(async () => {
    engine = await startEngine(python!);
    dir = tempDir('tp-serve-');
    svc = await Service.create({
      engineUrl: engine.url,
      dataDir: dir,
      port: 0,
      groupSize: 2,
      policy: { kind: 'windowed-fifo', window: 2 },
      packer: { tokenizer: 'qwen3', merge: { timelineCompareLevel: 'token' } },
    });
    base = await svc.listen();
  }, 180_000);

  afterAll(async () => {
    await svc?.close();
    engine?.stop();
  });

  it('records every call token for token, and packs what `treepack pack` packs', { timeout: 240_000 }, async () => {
    // Episode A: the episode and group in the base URL, nothing else configured.
    const a = new OpenAI({ baseURL: `${base}/groups/task-1/episodes/ep-a/v1`, apiKey: 'none' });
    const msgs: Msg[] = [
      { role: 'system', content: 'You are a helpful agent.' },
      { role: 'user', content: 'Find the capital of France.' },
    ];
    const r1 = await a.chat.completions.create({ model: 'tiny', messages: msgs, tools: TOOLS, max_tokens: 6 });
    expect((r1 as unknown as Record<string, unknown>).prompt_token_ids).toBeUndefined(); // the client sees what it asked for
    expect(r1.choices[0].logprobs ?? null).toBeNull();
    msgs.push({ role: 'assistant', content: r1.choices[0].message.content }, { role: 'user', content: 'Use the search tool.' });
    // A retry with temporary context (AgentJet's example): a hint added for one call only, then dropped.
    await a.chat.completions.create({
      model: 'tiny',
      messages: [...msgs, { role: 'user', content: 'Hint: be brief.' }],
      tools: TOOLS,
      max_tokens: 4,
    });
    const stream = await a.chat.completions.create({
      model: 'tiny',
      messages: msgs,
      tools: TOOLS,
      tool_choice: { type: 'function', function: { name: 'search' } },
      max_tokens: 5,
      stream: true,
    });
    let callName = '',
      callArgs = '',
      callId = '';
    for await (const chunk of stream) {
      for (const tc of chunk.choices[0]?.delta.tool_calls ?? []) {
        callName += tc.function?.name ?? '';
        callArgs += tc.function?.arguments ?? '';
        callId ||= tc.id ?? '';
      }
    }
    expect(callName).toBe('search');
    msgs.push({
      role: 'assistant',
      content: null,
      tool_calls: [{ id: callId, type: 'function', function: { name: callName, arguments: callArgs } }],
    });
    msgs.push({ role: 'tool', tool_call_id: callId, content: 'Paris is the capital of France.' });
    const s2 = await a.chat.completions.create({ model: 'tiny', messages: msgs, tools: TOOLS, max_tokens: 6, stream: true });
    let text = '';
    for await (const chunk of s2) text += chunk.choices[0]?.delta.content ?? '';
    expect(text.length).toBeGreaterThan(0);

    // Episode B: a scoped API key, two agents (header), and a legacy completion.
    const key = (await (
      await fetch(`${base}/v1/episodes`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ episode_id: 'ep-b', group: 'task-1' }),
      })
    ).json()) as { api_key: string };
    const planner = new OpenAI({ baseURL: `${base}/v1`, apiKey: key.api_key, defaultHeaders: { 'x-treepack-agent': 'planner' } });
    const coder = new OpenAI({ baseURL: `${base}/v1`, apiKey: key.api_key, defaultHeaders: { 'x-treepack-agent': 'coder' } });
    const p1 = await planner.chat.completions.create({
      model: 'tiny',
      messages: [{ role: 'user', content: 'Plan a trip.' }],
      max_tokens: 5,
      logprobs: true,
    });
    expect(p1.choices[0].logprobs?.content?.length).toBeGreaterThan(0); // asked for: passed through
    await coder.chat.completions.create({
      model: 'tiny',
      messages: [
        { role: 'system', content: 'You write code.' },
        { role: 'user', content: 'Write a loop.' },
      ],
      max_tokens: 5,
    });
    await planner.chat.completions.create({
      model: 'tiny',
      messages: [
        { role: 'user', content: 'Plan a trip.' },
        { role: 'assistant', content: p1.choices[0].message.content },
        { role: 'user', content: 'More.' },
      ],
      max_tokens: 5,
    });
    const c = await coder.completions.create({ model: 'tiny', prompt: 'def add(a, b):', max_tokens: 4 });
    expect(typeof c.choices[0].text).toBe('string');

    // Recorded = produced: the engine's log, call by call, in order.
    const produced = engine.log();
    const recorded = [];
    for (const ep of ['ep-a', 'ep-b']) {
      const body = (await (await fetch(`${base}/v1/episodes/${ep}`)).json()) as {
        calls: { agent?: string; output: { promptTokenIds: number[]; tokenIds: number[]; logprobs: number[] } }[];
      };
      recorded.push(...body.calls.map((c) => c.output));
      if (ep === 'ep-b') expect(body.calls.map((c) => c.agent)).toEqual(['planner', 'coder', 'planner', 'coder']);
    }
    expect(recorded).toHaveLength(8);
    expect(recorded.map((r) => [r.promptTokenIds, r.tokenIds, r.logprobs])).toEqual(
      produced.map((p) => [p.prompt_token_ids, p.token_ids, p.logprobs]),
    );

    // Finish the group and pull its micro-batch, and the JSONL the feed packed (until the step is acknowledged).
    for (const [ep, reward] of [
      ['ep-a', 1],
      ['ep-b', 0],
    ] as const) {
      const res = await fetch(`${base}/v1/episodes/${ep}/finish`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ reward }),
      });
      expect(res.status).toBe(200);
    }
    const res = await fetch(`${base}/v1/batches/next?rank=0&dp=1&wait=30`);
    expect(res.status).toBe(200);
    const entry = JSON.parse(res.headers.get('x-treepack-entry')!) as { id: string; groups: string[]; staleness: number };
    expect(entry.groups).toEqual(['task-1']);
    expect(entry.staleness).toBe(0);
    const bytes = new Uint8Array(await res.arrayBuffer());
    const jsonl =
      (await (await fetch(`${base}/v1/episodes/ep-a/records`)).text()) + (await (await fetch(`${base}/v1/episodes/ep-b/records`)).text());
    const feed = (await (await fetch(`${base}/v1/feed`)).json()) as {
      prompts: { promptMatched: number; promptDrifted: number; skipped: number };
    };
    // Every chat call's prompt is what the template renders: the chat path, mergeable (the completion has no messages).
    expect(feed.prompts).toMatchObject({ promptMatched: 7, promptDrifted: 0, skipped: 0 });

    // Every call's prompt + generated tokens is a packed sequence's prefix, trained on exactly the generated
    // tokens with the engine's logprobs.
    const t = parseSafetensors(bytes).tensors;
    const ids = t.get('input_ids')!.data as Int32Array,
      pos = t.get('seq_positions')!.data as Int32Array,
      off = t.get('seq_offsets')!.data as Int32Array;
    const mask = t.get('loss_mask')!.data as Uint8Array,
      lp = t.get('rollout_logprobs')!.data as Float32Array;
    const seqs = [];
    for (let i = 0; i + 1 < off.length; i++) {
      const idx = Array.from(pos.subarray(off[i], off[i + 1]));
      seqs.push({
        tokens: idx.map((p) => ids[p]),
        mask: Array.from(mask.subarray(off[i], off[i + 1])),
        lp: Array.from(lp.subarray(off[i], off[i + 1])),
      });
    }
    for (const p of produced) {
      const full = [...p.prompt_token_ids, ...p.token_ids];
      const hit = seqs.find(
        (s) =>
          s.tokens.length >= full.length &&
          full.every((x, k) => s.tokens[k] === x) &&
          p.token_ids.every((_, k) => s.mask[p.prompt_token_ids.length + k] === 1),
      );
      expect(hit, `a sequence trains call ${JSON.stringify(p.token_ids)}`).toBeDefined();
      expect(hit!.lp.slice(p.prompt_token_ids.length, full.length)).toEqual(p.logprobs.map((x) => Math.fround(x)));
    }
    // The retry's hint is its own timeline: not absorbed, so more sequences than the 3 chains A, B-planner, B-coder.
    expect(seqs.length).toBeGreaterThan(3);

    // Byte for byte what `treepack pack` writes for the same records.
    const input = join(dir, 'episodes.jsonl');
    writeFileSync(input, jsonl);
    const out = join(dir, 'packed');
    const r = cli(['pack', input, '--out', out, '--timeline-compare-level', 'token', '--tokenizer', 'qwen3', '--quiet']);
    expect(r.stderr).toBe('');
    const manifest = JSON.parse(readFileSync(join(out, 'manifest.json'), 'utf8')) as { micro_batches: { file: string }[] };
    expect(manifest.micro_batches).toHaveLength(1);
    expect(Buffer.from(bytes).equals(readFileSync(join(out, manifest.micro_batches[0].file)))).toBe(true);

    const ack = await fetch(`${base}/v1/batches/${entry.id}/ack`, { method: 'POST' });
    expect(await ack.json()).toMatchObject({ step_done: true, trainer_version: 1 });
    expect((await fetch(`${base}/v1/episodes/ep-a/records`)).status).toBe(410); // consumed: memory freed
  });

  it('the official openai Python client as the agent, treepack.client as the trainer', { timeout: 240_000 }, async () => {
    const script = `
import json, sys, urllib.request
from openai import OpenAI
from treepack.client import FeedClient
base = sys.argv[1]
for ep, reward in (("py-1", 1.0), ("py-2", 0.0)):
    client = OpenAI(base_url=f"{base}/groups/py-task/episodes/{ep}/v1", api_key="none")
    msgs = [{"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "Again."}]
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, stream=True) if c.choices)
    req = urllib.request.Request(f"{base}/v1/episodes/{ep}/finish", data=json.dumps({"reward": reward}).encode(), headers={"content-type": "application/json"})
    urllib.request.urlopen(req).read()
seen = []
for mb in FeedClient(base, rank=0, dp=1, wait=10, stop_when_idle=True):
    b = mb.batch
    seen.append({"id": mb.id, "groups": mb.entry["groups"], "dtype": str(b.input_ids.dtype), "sequences": b.num_sequences,
                 "trainable": int(b.loss_mask.sum()), "advantages": [float(x) for x in b.advantages[b.loss_mask].unique()], "ack": mb.ack()})
print(json.dumps(seen))
`;
    const before = engine.log().length;
    // Async: the service answering the script lives in this process.
    const r = await promisify(execFile)(python!, ['-c', script, base], {
      encoding: 'utf8',
      env: { ...process.env, PYTHONPATH: join(ROOT, 'python') },
      timeout: 200_000,
    });
    expect(r.stderr).not.toMatch(/Traceback/);
    const seen = JSON.parse(r.stdout.trim().split('\n').pop()!) as {
      groups: string[];
      dtype: string;
      sequences: number;
      trainable: number;
      advantages: number[];
      ack: { step_done: boolean };
    }[];
    expect(seen).toHaveLength(1);
    expect(seen[0].groups).toEqual(['py-task']);
    expect(seen[0].dtype).toBe('torch.int64');
    // Two episodes of two turns each, every turn's response trainable once: one merged sequence per episode.
    expect(seen[0].sequences).toBe(2);
    const produced = engine.log().slice(before);
    expect(seen[0].trainable).toBe(produced.reduce((a, p) => a + p.token_ids.length, 0));
    // GRPO over rewards 1 and 0 (mean 0.5, unbiased std sqrt(1/2), eps 1e-6) on every trainable token.
    const a = Math.fround(0.5 / (Math.SQRT1_2 + 1e-6));
    expect(seen[0].advantages.sort()).toEqual([-a, a]);
    expect(seen[0].ack.step_done).toBe(true);
  });
});
