/**
 * What the OpenAI Responses and Anthropic Messages routes share: both are translated to the engine's chat
 * completions (every engine speaks it, and the packer tokenizes chat messages), so a request becomes chat
 * messages and tools, the engine's chat answer (whole, or its SSE chunks) becomes the API's own answer or events,
 * and the call is recorded as the chat call it was. What a chat request cannot say is refused (400, naming the
 * field), never dropped.
 */
import { describeValue } from '../errors.js';
import type { EngineOutput, ToolCallOut } from './engine.js';
import { PoolError, type CallRequest, type RecordedCall } from './pool.js';

export type Obj = Record<string, unknown>;
export const isObj = (v: unknown): v is Obj => typeof v === 'object' && v !== null && !Array.isArray(v);

/** A request the translation cannot carry: a 400 naming the field. */
export function refuse(field: string, why: string): PoolError {
  return new PoolError(400, `field "${field}": ${why}`);
}

/** The call a translated request will be recorded as, and what the client asked for beyond it. */
export interface Translated {
  /** the chat-completions request (before the gateway asks for token ids and logprobs) */
  chat: Obj;
  /** messages and tools as recorded: what the packer tokenizes */
  request: CallRequest;
  stream: boolean;
  writer(call: CallMeta): ApiWriter;
  /** makes an output what the client is shown (tool call ids, as the writer names them) before it is recorded */
  complete(o: EngineOutput, call: CallMeta): void;
}

export interface CallMeta {
  /** the recorded call's id: every id the client sees derives from it, so a replayed answer repeats them */
  id: string;
  /** ms */
  time: number;
}

/**
 * Turns the engine's chat chunks (choice 0) into one API's answer. A complete answer is the writer fed one chunk
 * holding the whole output (`wholeChunk`), so a streamed answer and a complete one are built alike.
 */
export interface ApiWriter {
  /** the SSE text an engine chunk becomes (may be '') */
  chunk(chunk: Obj): string;
  /** the SSE text that ends the stream, once the call is recorded */
  end(): string;
  /** the SSE text of a failure after the headers went out */
  fail(message: string): string;
  /** the complete answer, after the chunks */
  answer(): Obj;
}

export function sse(event: string, data: Obj): string {
  return `event: ${event}\ndata: ${JSON.stringify(data)}\n\n`;
}

/** One chat chunk carrying a whole output (a complete response, or a recorded call replayed). */
export function wholeChunk(o: EngineOutput, extra: { logprobs?: unknown; usage?: unknown; stopReason?: unknown } = {}): Obj {
  const m = o.message;
  const delta: Obj = { role: 'assistant' };
  if (m?.reasoning_content) delta.reasoning_content = m.reasoning_content;
  if (m?.content !== null && m?.content !== undefined) delta.content = m.content;
  if (m?.tool_calls) delta.tool_calls = m.tool_calls.map((c, index) => ({ index, ...c }));
  const choice: Obj = { index: 0, delta, finish_reason: o.finishReason, logprobs: extra.logprobs ?? null };
  if (extra.stopReason !== undefined) choice.stop_reason = extra.stopReason;
  if (o.tokenIds) choice.token_ids = o.tokenIds;
  const chunk: Obj = { choices: [choice] };
  if (o.promptTokenIds) chunk.prompt_token_ids = o.promptTokenIds;
  if (extra.usage !== undefined) chunk.usage = extra.usage;
  return chunk;
}

/**
 * Gives every tool call an id and the type `function`, so the call recorded is the one the client sees and sends
 * back in its next turn: an engine's call without an id gets `${prefix}${call}_${index}`, as the writers name it.
 */
export function completeToolCalls(o: EngineOutput, prefix: string, callId: string): void {
  o.message?.tool_calls?.forEach((c, i) => {
    c.id ??= toolCallId(prefix, callId, i);
    c.type ??= 'function';
  });
}

export const toolCallId = (prefix: string, callId: string, index: number): string => `${prefix}${callId}_${index}`;

/** A chat tool call as the translated requests write it (the key order of engine.ts's ToolCallOut). */
export function chatToolCall(id: string, name: string, args: string): ToolCallOut {
  return { id, type: 'function', function: { name, arguments: args } };
}

/**
 * The text of content parts whose type is in `text`, joined by "\n" as vLLM joins a message's text parts for a
 * template that takes a string; another part type is refused, naming it.
 */
export function joinText(parts: unknown, field: string, text: readonly string[]): string {
  if (typeof parts === 'string') return parts;
  if (!Array.isArray(parts)) throw refuse(field, `expected a string or a list of content parts, got ${describeValue(parts)}`);
  return parts
    .map((p, i) => {
      if (!isObj(p) || typeof p.type !== 'string')
        throw refuse(`${field}[${i}]`, `expected a content part with a type, got ${describeValue(p)}`);
      if (!text.includes(p.type))
        throw refuse(
          `${field}[${i}].type`,
          `content of type ${JSON.stringify(p.type)} is not supported by the gateway (text only: ${text.join(', ')}); see docs/guides/agent-apis.md`,
        );
      const key = p.type === 'refusal' ? 'refusal' : 'text'; // the Responses API's refusal part
      if (typeof p[key] !== 'string') throw refuse(`${field}[${i}].${key}`, `expected a string, got ${describeValue(p[key])}`);
      return p[key];
    })
    .join('\n');
}

/** The tool calls an episode's calls produced, by id: a later turn that sends one back is matched against it. */
export function priorToolCalls(calls: readonly RecordedCall[] | undefined): Map<string, ToolCallOut> {
  const out = new Map<string, ToolCallOut>();
  for (const c of calls ?? [])
    for (const o of [c.output, ...(c.siblings ?? [])])
      for (const t of o.message?.tool_calls ?? []) if (t.id !== undefined) out.set(t.id, t);
  return out;
}

/** Fields the gateway reads; the rest of a request goes to the engine's chat completions as they are. */
export function passThrough(body: Obj, handled: ReadonlySet<string>): Obj {
  const out: Obj = {};
  for (const [k, v] of Object.entries(body)) if (!handled.has(k) && v !== undefined) out[k] = v;
  return out;
}

/** Counts of the chat usage object, or of the token ids where the engine sent no usage. */
export function usageCounts(usage: unknown, promptIds: number, outputIds: number): { input: number; output: number } {
  if (isObj(usage) && Number.isSafeInteger(usage.prompt_tokens) && Number.isSafeInteger(usage.completion_tokens))
    return { input: usage.prompt_tokens as number, output: usage.completion_tokens as number };
  return { input: promptIds, output: outputIds };
}
