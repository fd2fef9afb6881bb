/**
 * A stub OpenAI-compatible engine for the service's error, durability and latency tests (and the bench): answers
 * at once with a numbered reply, or misbehaves on purpose. It answers as vLLM does where it matters to the
 * gateway: `n` choices (each its own `index`; streamed, their chunks interleave), reasoning_content under
 * `chat_template_kwargs.enable_thinking` (generated as Qwen3 writes it, inside <think>), a call of the named function
 * where `tool_choice` names one (or of the first tool where it is "required"), usage, a last usage-only chunk
 * under `stream_options.include_usage`, and, given a tokenizer, vLLM's `return_token_ids` (top-level
 * `prompt_token_ids`: the chat template rendered as transformers renders it, a tool-calling turn's null content
 * as empty text; per-choice `token_ids`: the generated text's tokens and the end-of-turn token) with logprobs.
 * Without a tokenizer, replies carry no token ids: the gateway then renders with the chat template. With `routes`,
 * replies carry the experts an MoE engine routed the prompt and generated tokens to (all but the last token), as
 * vLLM (`choices[k].routed_experts`: base64 of an .npy int32 array) or SGLang (`choices[k].sgl_ext.routed_experts`,
 * on request `return_routed_experts`: base64 of flat int32); streamed, on each choice's last chunk. Given a VL
 * tokenizer (one with an image processor), each image part's placeholder in `prompt_token_ids` is expanded as vLLM
 * expands it: into the processor's count for the image (`imageSettings`: the engine serves other settings).
 */
import { createServer, type Server } from 'node:http';
import type { TextTokenizer } from '../../src/index.js';
import { decodeImage, type ImageProcessor } from '../../src/records/images.js';
import { processImage } from '../../src/tokenize/images.js';

export type StubMode = 'ok' | 'garbage' | 'no-choices' | 'hang' | 'error-500' | 'bad-logprobs' | 'stall-stream';

export interface StubEngine {
  url: string;
  server: Server;
  /** requests answered, the model list's aside */
  calls: number;
  mode: StubMode;
  /** when set, requests must carry it as their bearer token (401 otherwise) */
  apiKey?: string;
  /** when set, each answer waits this long (a long generation) */
  delayMs?: number;
  /** with `record`: every chat or completion request body as received, and what each choice generated */
  requests: Record<string, unknown>[];
  produced: { prompt_token_ids: number[]; token_ids: number[]; logprobs: number[] }[];
  /** with a VL tokenizer: processor settings the engine serves in place of the tokenizer directory's */
  imageSettings?: Partial<ImageProcessor>;
  close: () => Promise<void>;
}

/** `ids` with the k-th image placeholder repeated as many times as processor `p` expands the k-th image part of `messages`. */
function expandImages(ids: number[], messages: Obj[], p: ImageProcessor): number[] {
  const counts = messages
    .flatMap((m) => (Array.isArray(m.content) ? (m.content as Obj[]) : []))
    .filter((part) => part.type === 'image_url')
    .map((part) => {
      const url = (part.image_url as { url: string }).url;
      return processImage(decodeImage(Buffer.from(url.slice(url.indexOf(',') + 1), 'base64')), p).tokens;
    });
  let k = 0;
  return ids.flatMap((t) => (t === p.image_token_id && k < counts.length ? new Array<number>(counts[k++]).fill(t) : [t]));
}

type Obj = Record<string, unknown>;

/** How the stub routes tokens: its layers, experts per token and experts; `short` leaves one more token unrouted. */
export interface StubRoutes {
  form: 'vllm' | 'sglang';
  layers: number;
  topK: number;
  experts: number;
  short?: boolean;
}

/**
 * The experts the stub routes each token of `ids` to ([layers × topK] per token; `from`: the position of `ids[0]` in
 * its sequence): a function of token and position, so a test can recompute them.
 */
export function stubRoutes(ids: number[], r: Pick<StubRoutes, 'layers' | 'topK' | 'experts'>, from = 0): Int32Array {
  const out = new Int32Array(ids.length * r.layers * r.topK);
  ids.forEach((id, i) => {
    const t = from + i;
    for (let l = 0; l < r.layers; l++)
      for (let j = 0; j < r.topK; j++) out[(i * r.layers + l) * r.topK + j] = (id * 3 + t + l * 5 + j) % r.experts;
  });
  return out;
}

/** base64 of a NumPy .npy (format 1.0) of `values`, int32 [rows, layers, topK], as numpy.save writes it. */
export function npyBase64(values: Int32Array, shape: [number, number, number]): string {
  let header = `{'descr': '<i4', 'fortran_order': False, 'shape': (${shape.join(', ')}), }`;
  header += ' '.repeat(63 - ((10 + header.length) % 64)) + '\n';
  const head = Buffer.alloc(10);
  Buffer.from([0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 1, 0]).copy(head);
  head.writeUInt16LE(header.length, 8);
  return Buffer.concat([head, Buffer.from(header, 'latin1'), Buffer.from(values.buffer, values.byteOffset, values.byteLength)]).toString(
    'base64',
  );
}

interface Choice {
  content: string | null;
  /** with chat_template_kwargs.enable_thinking: what vLLM's reasoning parser returns as reasoning_content */
  reasoning?: string;
  call?: { id: string; name: string; arguments: string };
  ids?: number[];
  logprobs?: number[];
}

/** A logprob for token `t` at position `i`: fixed, so a test can recompute it. */
export const stubLogprob = (t: number, i: number): number => -((t % 7) + i + 1) / 16;

export async function startStubEngine(
  mode: StubMode = 'ok',
  opts: { tokenizer?: TextTokenizer; record?: boolean; routes?: StubRoutes } = {},
): Promise<StubEngine> {
  const stub = { calls: 0, mode, requests: [], produced: [] } as unknown as StubEngine;
  const tok = opts.tokenizer;
  const eos = tok?.addedTokenId('<|im_end|>');
  const server = createServer((req, res) => {
    let body = '';
    req.on('data', (d: Buffer) => (body += d.toString()));
    req.on('end', () => (stub.delayMs ? setTimeout(answer, stub.delayMs) : answer()));
    const answer = () => {
      // the model list is not a call: the service lists the models at each start-up
      const n = req.method === 'GET' && req.url === '/v1/models' ? stub.calls : stub.calls++;
      const send = (code: number, text: string, type = 'application/json') => {
        res.writeHead(code, { 'content-type': type, 'content-length': Buffer.byteLength(text) });
        res.end(text);
      };
      if (stub.apiKey !== undefined && req.headers.authorization !== `Bearer ${stub.apiKey}`)
        return send(401, JSON.stringify({ error: { message: 'bad engine key' } }));
      if (req.method === 'GET' && req.url === '/v1/models')
        return send(200, JSON.stringify({ object: 'list', data: [{ id: 'stub', object: 'model' }] }));
      if (stub.mode === 'hang') return; // never answers
      if (stub.mode === 'garbage') return send(200, '<html>oops</html>', 'text/html');
      if (stub.mode === 'error-500') return send(500, JSON.stringify({ error: { message: 'engine overloaded' } }));
      if (stub.mode === 'no-choices') return send(200, JSON.stringify({ id: 'x', choices: [] }));
      const req0 = JSON.parse(body) as Obj;
      if (opts.record) stub.requests.push(req0);
      const chat = req.url === '/v1/chat/completions';
      const wantIds = tok !== undefined && req0.return_token_ids === true;
      const wantLp = tok !== undefined && req0.logprobs !== undefined && req0.logprobs !== null && req0.logprobs !== false;
      let promptIds: number[] | undefined;
      if (tok) {
        // As vLLM does: a tool-calling assistant turn's null content is rendered as empty text.
        const text = chat
          ? tok.chatTemplate.render({
              ...tok.templateVars,
              messages: (req0.messages as Obj[]).map((m) => ({ ...m, content: m.content ?? '' })),
              tools: (req0.tools as unknown[] | undefined)?.length ? req0.tools : undefined,
              add_generation_prompt: true,
            })
          : (req0.prompt as string);
        promptIds = [...tok.encode(text)];
        if (chat && tok.imageProcessor)
          promptIds = expandImages(promptIds, req0.messages as Obj[], { ...tok.imageProcessor, ...stub.imageSettings });
      }
      const tools = (req0.tools as { function: { name: string } }[] | undefined) ?? [];
      const tc = req0.tool_choice as { function?: { name: string } } | string | undefined;
      const named = typeof tc === 'object' ? tc.function?.name : tc === 'required' ? tools[0]?.function.name : undefined;
      const thinking = (req0.chat_template_kwargs as Obj | undefined)?.enable_thinking === true;
      const choices: Choice[] = [];
      for (let j = 0; j < ((req0.n as number | undefined) ?? 1); j++) {
        const tag = j === 0 ? `${n}` : `${n}.${j}`;
        const c: Choice = named
          ? { content: null, call: { id: `call_${tag.replace('.', '_')}`, name: named, arguments: `{"query": "q ${tag}"}` } }
          : { content: `reply ${tag}` };
        if (thinking && !c.call) c.reasoning = `thought ${tag}`;
        if (tok) {
          const think = c.reasoning === undefined ? '' : `<think>\n${c.reasoning}\n</think>\n\n`;
          const gen = c.call
            ? `<tool_call>\n{"name": "${c.call.name}", "arguments": ${c.call.arguments}}\n</tool_call>`
            : think + c.content!;
          c.ids = chat ? [...tok.encode(gen), eos!] : [...tok.encode(gen)];
          c.logprobs = c.ids.map(stubLogprob);
        }
        choices.push(c);
        if (opts.record && c.ids) stub.produced.push({ prompt_token_ids: promptIds!, token_ids: c.ids, logprobs: c.logprobs! });
      }
      const routed = opts.routes;
      const routesOf = (c: Choice): Obj | undefined => {
        if (!routed || !c.ids || (routed.form === 'sglang' && req0.return_routed_experts !== true)) return undefined;
        const ids = [...promptIds!, ...c.ids].slice(0, routed.short ? -2 : -1); // the last token is never fed back
        const values = stubRoutes(ids, routed);
        if (routed.form === 'vllm') return { routed_experts: npyBase64(values, [ids.length, routed.layers, routed.topK]) };
        return { sgl_ext: { routed_experts: Buffer.from(values.buffer, values.byteOffset, values.byteLength).toString('base64') } };
      };
      const usage = { prompt_tokens: promptIds?.length ?? 0, completion_tokens: choices.reduce((a, c) => a + (c.ids?.length ?? 0), 0) };
      const finish = (c: Choice) => (c.call ? (typeof tc === 'object' ? 'stop' : 'tool_calls') : 'stop'); // vLLM: a named tool choice ends with stop
      const lp = (c: Choice, from: number, to: number) => {
        if (stub.mode === 'bad-logprobs') return { content: [{ token: 'x', logprob: 'high' }] };
        if (!wantLp || !c.logprobs) return null;
        const range = c
          .ids!.slice(from, to)
          .map((t, i) => ({ token: tok.decode([t]), logprob: c.logprobs![from + i], bytes: null, top_logprobs: [] }));
        return chat
          ? { content: range }
          : { tokens: range.map((r) => r.token), token_logprobs: range.map((r) => r.logprob), top_logprobs: null, text_offset: [] };
      };
      if (req0.stream) {
        res.writeHead(200, { 'content-type': 'text/event-stream' });
        const event = (choice: Obj, first: boolean) => {
          const chunk: Obj = { id: `c${n}`, object: chat ? 'chat.completion.chunk' : 'text_completion', model: 'stub', choices: [choice] };
          if (first && wantIds) chunk.prompt_token_ids = promptIds;
          res.write(`data: ${JSON.stringify(chunk)}\n\n`);
        };
        // As vLLM: a chat stream opens with the role and empty text; then each choice in two pieces, the choices'
        // chunks interleaved.
        if (chat)
          choices.forEach((_, index) =>
            event({ index, delta: { role: 'assistant', content: '' }, finish_reason: null, logprobs: null }, false),
          );
        const pieces = choices.map((c) => {
          const half = c.ids ? Math.ceil((c.ids.length - 1) / 2) : 0;
          const text = c.call ? c.call.arguments : c.content!;
          const cut = Math.ceil(text.length / 2);
          return { c, half, parts: [text.slice(0, cut), text.slice(cut)] };
        });
        pieces.forEach(({ c, half, parts }, index) => {
          const choice: Obj = { index, finish_reason: null, logprobs: lp(c, 0, half) };
          if (!chat) choice.text = parts[0];
          else if (c.call)
            choice.delta = {
              role: 'assistant',
              tool_calls: [{ index: 0, id: c.call.id, type: 'function', function: { name: c.call.name, arguments: parts[0] } }],
            };
          else if (c.reasoning !== undefined) choice.delta = { role: 'assistant', reasoning_content: c.reasoning };
          else choice.delta = { role: 'assistant', content: parts[0] };
          if (wantIds) choice.token_ids = c.ids!.slice(0, half);
          event(choice, index === 0);
        });
        if (stub.mode === 'stall-stream') return; // the first chunk, then nothing
        pieces.forEach(({ c, half, parts }, index) => {
          const choice: Obj = { index, finish_reason: finish(c), logprobs: lp(c, half, c.ids?.length ?? 0) };
          if (!chat) choice.text = parts[1];
          else if (c.call) choice.delta = { tool_calls: [{ index: 0, function: { arguments: parts[1] } }] };
          else if (c.reasoning !== undefined) choice.delta = { content: parts[0] + parts[1] };
          else choice.delta = { content: parts[1] };
          if (wantIds) choice.token_ids = c.ids!.slice(half);
          Object.assign(choice, routesOf(c));
          event(choice, false);
        });
        if ((req0.stream_options as Obj | undefined)?.include_usage)
          res.write(
            `data: ${JSON.stringify({ id: `c${n}`, choices: [], usage: { ...usage, total_tokens: usage.prompt_tokens + usage.completion_tokens } })}\n\n`,
          );
        res.end('data: [DONE]\n\n');
        return;
      }
      const out = choices.map((c, index) => {
        const choice: Obj = { index, finish_reason: finish(c), logprobs: lp(c, 0, c.ids?.length ?? 0) };
        if (!chat) choice.text = c.content ?? '';
        else if (c.call)
          choice.message = {
            role: 'assistant',
            content: null,
            tool_calls: [{ id: c.call.id, type: 'function', function: { name: c.call.name, arguments: c.call.arguments } }],
          };
        else
          choice.message =
            c.reasoning === undefined
              ? { role: 'assistant', content: c.content }
              : { role: 'assistant', content: c.content, reasoning_content: c.reasoning };
        if (wantIds) choice.token_ids = c.ids;
        Object.assign(choice, routesOf(c));
        return choice;
      });
      const json: Obj = {
        id: `c${n}`,
        object: chat ? 'chat.completion' : 'text_completion',
        model: 'stub',
        choices: out,
        usage: { ...usage, total_tokens: usage.prompt_tokens + usage.completion_tokens },
      };
      if (wantIds) json.prompt_token_ids = promptIds;
      send(200, JSON.stringify(json));
    };
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  stub.server = server;
  stub.url = `http://127.0.0.1:${(server.address() as { port: number }).port}/v1`;
  stub.close = () =>
    new Promise((r) => {
      server.closeAllConnections();
      server.close(() => r());
    });
  return stub;
}
