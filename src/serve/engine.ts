/**
 * The engine side of the gateway: what is added to a client's request so the engine returns its tokens
 * (vLLM/SGLang-style `return_token_ids` and OpenAI `logprobs`), what is read back from a response or an SSE
 * stream, and what is taken out again so the client sees the answer it asked for.
 *
 * Engine output formats read (vLLM >= 0.10.2, OpenAI):
 *  - prompt ids: `prompt_token_ids` at the top level (chat) or on the choice (completions);
 *  - generated ids: `choices[k].token_ids` (streamed: one list per chunk, concatenated per choice `index`);
 *  - logprobs: `choices[k].logprobs.content[i].logprob` (chat) or `choices[k].logprobs.token_logprobs[i]`
 *    (completions);
 *  - routed experts (MoE routing replay): routed-experts.ts reads and checks them.
 * Every choice is read (`n` > 1: one output per choice, in `index` order; they share the prompt).
 */
import { describeValue } from '../errors.js';
import { choiceRoutes, stripRoutes, type RawRoutes, type RecordedRoutes } from './routed-experts.js';

export type CallKind = 'chat' | 'completion';

export interface ToolCallOut {
  id?: string;
  type?: string;
  function: { name: string; arguments: string };
}

export interface EngineOutput {
  /** chat: the assistant message; completion: undefined */
  message?: { role: 'assistant'; content: string | null; tool_calls?: ToolCallOut[]; reasoning_content?: string };
  /** completion: the generated text */
  text?: string;
  finishReason: string | null;
  promptTokenIds?: number[];
  tokenIds?: number[];
  logprobs?: number[];
  /** the experts the engine routed the prompt's and the generated tokens to (routed-experts.ts) */
  routes?: RecordedRoutes;
}

/**
 * The ids of the models the engine serves (`GET {engine}/models`, OpenAI's list): what the service checks as it
 * starts. Rejects with a message saying what is wrong with the engine or its URL.
 */
export async function engineModels(engineUrl: string, apiKey: string | undefined, timeoutMs: number): Promise<string[]> {
  const url = `${engineUrl}/models`;
  let res: Response;
  try {
    res = await fetch(url, { headers: apiKey ? { authorization: `Bearer ${apiKey}` } : {}, signal: AbortSignal.timeout(timeoutMs) });
  } catch (err) {
    const e = err as Error & { cause?: Error };
    throw new Error(
      `the engine at ${engineUrl} is unreachable (GET ${url}: ${e.name === 'TimeoutError' ? `no answer within ${timeoutMs} ms` : (e.cause?.message ?? e.message)})`,
      { cause: err },
    );
  }
  const text = await res.text();
  if (!res.ok) {
    const hint = res.status === 401 || res.status === 403 ? 'its key: --engine-api-key' : 'is --engine its OpenAI base URL, ending in /v1?';
    throw new Error(`the engine at ${engineUrl} answered GET ${url} with HTTP ${res.status} (${hint}): ${text.slice(0, 200)}`);
  }
  let json: unknown;
  try {
    json = JSON.parse(text);
  } catch {
    // not JSON: refused below
  }
  const ids =
    isObj(json) && Array.isArray(json.data) ? json.data.map((m) => (isObj(m) && typeof m.id === 'string' ? m.id : undefined)) : undefined;
  if (!ids || ids.includes(undefined))
    throw new Error(
      `the engine at ${engineUrl} answered GET ${url} with no OpenAI model list ({"data": [{"id": …}]}): ${describeValue(text)}`,
    );
  if (ids.length === 0) throw new Error(`the engine at ${engineUrl} serves no model (GET ${url} lists none)`);
  return ids as string[];
}

/** What the client asked to see of the fields the gateway adds. */
export interface ClientWants {
  logprobs: boolean;
  tokenIds: boolean;
  /** the engine's routed experts (`return_routed_experts: true`) */
  routes: boolean;
}

/** A response the engine sent that cannot be recorded: a 502 to the client, naming the field. */
export class EngineError extends Error {
  constructor(
    message: string,
    readonly field?: string,
  ) {
    super(field ? `engine response field ${JSON.stringify(field)}: ${message}` : message);
  }
}

type Obj = Record<string, unknown>;
const isObj = (v: unknown): v is Obj => typeof v === 'object' && v !== null && !Array.isArray(v);

/** The request sent upstream: the client's, asking also for token ids and per-token logprobs. */
export function upstreamRequest(kind: CallKind, body: Obj): { body: Obj; wants: ClientWants } {
  const wants: ClientWants = {
    logprobs: kind === 'chat' ? body.logprobs === true : typeof body.logprobs === 'number' && body.logprobs >= 0,
    tokenIds: body.return_token_ids === true,
    routes: body.return_routed_experts === true,
  };
  const out: Obj = { ...body, return_token_ids: true };
  if (kind === 'chat') out.logprobs = true;
  else if (!wants.logprobs) out.logprobs = 0; // legacy completions: an int, 0 = the sampled token only
  return { body: out, wants };
}

/** Strips what the gateway added and the client did not ask for (in place). */
export function clientView(json: Obj, wants: ClientWants): Obj {
  if (!wants.routes) stripRoutes(json);
  if (!wants.tokenIds) delete json.prompt_token_ids;
  if (Array.isArray(json.choices)) {
    for (const c of json.choices) {
      if (!isObj(c)) continue;
      if (!wants.tokenIds) {
        delete c.token_ids;
        delete c.prompt_token_ids;
      }
      if (!wants.logprobs) c.logprobs = null;
    }
  }
  return json;
}

function ids(v: unknown, field: string): number[] | undefined {
  if (v === undefined || v === null) return undefined;
  if (!Array.isArray(v) || !v.every((x) => Number.isInteger(x) && x >= 0))
    throw new EngineError(`expected a list of token ids, got ${describeValue(v)}`, field);
  return v as number[];
}

function logprobList(kind: CallKind, lp: unknown, field: string): number[] | undefined {
  if (lp === undefined || lp === null) return undefined;
  if (!isObj(lp)) throw new EngineError(`expected a logprobs object, got ${describeValue(lp)}`, field);
  const out: number[] = [];
  if (kind === 'chat') {
    if (lp.content === null || lp.content === undefined) return undefined;
    if (!Array.isArray(lp.content)) throw new EngineError(`expected a list, got ${describeValue(lp.content)}`, `${field}.content`);
    lp.content.forEach((e, i) => out.push(finiteLogprob(isObj(e) ? e.logprob : e, `${field}.content[${i}].logprob`)));
  } else {
    if (lp.token_logprobs === null || lp.token_logprobs === undefined) return undefined;
    if (!Array.isArray(lp.token_logprobs))
      throw new EngineError(`expected a list, got ${describeValue(lp.token_logprobs)}`, `${field}.token_logprobs`);
    lp.token_logprobs.forEach((x, i) => out.push(finiteLogprob(x, `${field}.token_logprobs[${i}]`)));
  }
  return out;
}

function finiteLogprob(x: unknown, field: string): number {
  if (typeof x !== 'number' || !Number.isFinite(x) || x > 1e-3)
    throw new EngineError(`expected a finite log-probability <= 0, got ${describeValue(x)}`, field);
  return x;
}

function toolCalls(v: unknown, field: string): ToolCallOut[] | undefined {
  if (v === undefined || v === null) return undefined;
  if (!Array.isArray(v)) throw new EngineError(`expected a list of tool calls, got ${describeValue(v)}`, field);
  return v.map((c, i) => {
    const fn = isObj(c) ? c.function : undefined;
    if (!isObj(c) || !isObj(fn) || typeof fn.name !== 'string')
      throw new EngineError(`expected {"function": {"name", "arguments"}}, got ${describeValue(c)}`, `${field}[${i}]`);
    const call: ToolCallOut = {
      function: { name: fn.name, arguments: typeof fn.arguments === 'string' ? fn.arguments : JSON.stringify(fn.arguments ?? {}) },
    };
    if (typeof c.id === 'string') call.id = c.id;
    if (typeof c.type === 'string') call.type = c.type;
    return call;
  });
}

/** The choices of a response or chunk, each at its `index` (its list position where it has none). */
function choicesByIndex(json: Obj, n: number): Map<number, { c: Obj; at: string }> {
  if (!Array.isArray(json.choices)) throw new EngineError(`expected a list of choices, got ${describeValue(json.choices)}`, 'choices');
  const out = new Map<number, { c: Obj; at: string }>();
  json.choices.forEach((c, i) => {
    if (!isObj(c)) throw new EngineError(`expected a choice object, got ${describeValue(c)}`, `choices[${i}]`);
    const index = c.index === undefined ? i : c.index;
    if (!Number.isSafeInteger(index) || (index as number) < 0 || (index as number) >= n) {
      throw new EngineError(`expected an integer in 0..${n - 1} (the request's n), got ${describeValue(c.index)}`, `choices[${i}].index`);
    }
    out.set(index as number, { c, at: `choices[${i}]` });
  });
  return out;
}

/** The recordable part of a complete (non-streamed) response: one output per choice, `n` of them. */
export function parseResponse(kind: CallKind, json: unknown, n = 1): EngineOutput[] {
  if (!isObj(json)) throw new EngineError(`expected a JSON object, got ${describeValue(json)}`);
  const byIndex = choicesByIndex(json, n);
  if (byIndex.size !== n) throw new EngineError(`expected ${n} choice(s) (the request's n), got ${byIndex.size}`, 'choices');
  const outputs: EngineOutput[] = [];
  for (let k = 0; k < n; k++) {
    const { c, at } = byIndex.get(k)!;
    const out: EngineOutput = { finishReason: typeof c.finish_reason === 'string' ? c.finish_reason : null };
    if (kind === 'chat') {
      const m = c.message;
      if (!isObj(m)) throw new EngineError(`expected a message object, got ${describeValue(m)}`, `${at}.message`);
      if (m.content !== null && m.content !== undefined && typeof m.content !== 'string')
        throw new EngineError(`expected a string or null, got ${describeValue(m.content)}`, `${at}.message.content`);
      out.message = { role: 'assistant', content: m.content ?? null };
      const calls = toolCalls(m.tool_calls, `${at}.message.tool_calls`);
      if (calls && calls.length) out.message.tool_calls = calls;
      const reasoning = m.reasoning_content ?? m.reasoning;
      if (typeof reasoning === 'string' && reasoning !== '') out.message.reasoning_content = reasoning;
    } else {
      if (typeof c.text !== 'string') throw new EngineError(`expected a string, got ${describeValue(c.text)}`, `${at}.text`);
      out.text = c.text;
    }
    const prompt = ids(json.prompt_token_ids ?? c.prompt_token_ids, 'prompt_token_ids');
    if (prompt) out.promptTokenIds = prompt;
    const gen = ids(c.token_ids, `${at}.token_ids`);
    if (gen) out.tokenIds = gen;
    const lp = logprobList(kind, c.logprobs, `${at}.logprobs`);
    if (lp) out.logprobs = lp;
    outputs.push(out);
  }
  return outputs;
}

/** The routes each of a complete response's `n` choices carries (routed-experts.ts), by choice. */
export function responseRoutes(json: Obj, n = 1): (RawRoutes | undefined)[] {
  const out = new Array<RawRoutes | undefined>(n);
  for (const [k, { c, at }] of choicesByIndex(json, n)) out[k] = choiceRoutes(json, c, at);
  return out;
}

/** One choice's stream, folded. */
class ChoiceStream {
  content = '';
  sawContent = false;
  reasoning = '';
  readonly calls: { id?: string; type?: string; name: string; args: string }[] = [];
  finishReason: string | null = null;
  prompt: number[] | undefined;
  tokens: number[] | undefined;
  logprobs: number[] | undefined;
}

/** Folds the chunks of an SSE stream into the same EngineOutputs as a complete response, one per choice. */
export class StreamAccumulator {
  private readonly choices: ChoiceStream[] = [];
  private prompt: number[] | undefined;
  /** each choice's routes: from the chunk that carries them (the last one, were there several) */
  readonly routes: (RawRoutes | undefined)[] = [];

  constructor(
    private readonly kind: CallKind,
    private readonly n = 1,
  ) {
    for (let k = 0; k < n; k++) this.choices.push(new ChoiceStream());
  }

  add(chunk: unknown): void {
    if (!isObj(chunk)) throw new EngineError(`expected a JSON object per stream event, got ${describeValue(chunk)}`);
    const prompt = ids(chunk.prompt_token_ids, 'prompt_token_ids');
    if (prompt) this.prompt = prompt;
    // A usage-only chunk.
    if (chunk.choices === undefined || chunk.choices === null || (Array.isArray(chunk.choices) && chunk.choices.length === 0)) return;
    for (const [k, { c, at }] of choicesByIndex(chunk, this.n)) {
      this.addChoice(this.choices[k], c, at);
      this.routes[k] = choiceRoutes(chunk, c, at) ?? this.routes[k];
    }
  }

  private addChoice(s: ChoiceStream, c: Obj, at: string): void {
    if (typeof c.finish_reason === 'string') s.finishReason = c.finish_reason;
    const p = ids(c.prompt_token_ids, `${at}.prompt_token_ids`);
    if (p) s.prompt = p;
    const t = ids(c.token_ids, `${at}.token_ids`);
    if (t) (s.tokens ??= []).push(...t);
    const lp = logprobList(this.kind, c.logprobs, `${at}.logprobs`);
    if (lp) (s.logprobs ??= []).push(...lp);
    if (this.kind === 'completion') {
      if (c.text !== undefined && typeof c.text !== 'string')
        throw new EngineError(`expected a string, got ${describeValue(c.text)}`, `${at}.text`);
      s.content += c.text ?? '';
      return;
    }
    const d = c.delta;
    if (d === undefined || d === null) return;
    if (!isObj(d)) throw new EngineError(`expected a delta object, got ${describeValue(d)}`, `${at}.delta`);
    if (typeof d.content === 'string') {
      s.content += d.content;
      s.sawContent = true;
    }
    const r = d.reasoning_content ?? d.reasoning;
    if (typeof r === 'string') s.reasoning += r;
    if (d.tool_calls !== undefined && d.tool_calls !== null) {
      if (!Array.isArray(d.tool_calls))
        throw new EngineError(`expected a list, got ${describeValue(d.tool_calls)}`, `${at}.delta.tool_calls`);
      for (const tc of d.tool_calls) {
        if (!isObj(tc)) throw new EngineError(`expected a tool call delta, got ${describeValue(tc)}`, `${at}.delta.tool_calls`);
        const index = Number.isInteger(tc.index) ? (tc.index as number) : s.calls.length;
        const call = (s.calls[index] ??= { name: '', args: '' });
        if (typeof tc.id === 'string') call.id = tc.id;
        if (typeof tc.type === 'string') call.type = tc.type;
        const fn = isObj(tc.function) ? tc.function : {};
        if (typeof fn.name === 'string') call.name += fn.name;
        if (typeof fn.arguments === 'string') call.args += fn.arguments;
      }
    }
  }

  result(): EngineOutput[] {
    return this.choices.map((s) => {
      const out: EngineOutput = { finishReason: s.finishReason };
      if (this.kind === 'chat') {
        out.message = { role: 'assistant', content: s.sawContent ? s.content : null };
        const calls = s.calls.filter((c) => c !== undefined);
        if (calls.length) {
          out.message.tool_calls = calls.map((c) => {
            const call: ToolCallOut = { function: { name: c.name, arguments: c.args } };
            if (c.id !== undefined) call.id = c.id;
            if (c.type !== undefined) call.type = c.type;
            return call;
          });
        }
        if (s.reasoning) out.message.reasoning_content = s.reasoning;
      } else out.text = s.content;
      const prompt = s.prompt ?? this.prompt;
      if (prompt) out.promptTokenIds = prompt;
      if (s.tokens) out.tokenIds = s.tokens;
      if (s.logprobs) out.logprobs = s.logprobs;
      return out;
    });
  }
}
