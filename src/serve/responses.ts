/**
 * The OpenAI Responses API (`POST /v1/responses`) on the engine's chat completions: a request's instructions and
 * input items become chat messages (function_call and function_call_output items: an assistant tool call and a
 * tool message; reasoning items: the assistant's reasoning_content), its function tools chat tools; the engine's
 * chat answer becomes a Response with reasoning, message and function_call output items, or its SSE events
 * (response.created … response.completed). The service keeps no responses: `previous_response_id`,
 * `conversation` and item references are refused, as are built-in tools and non-text content.
 */
import { describeValue } from '../errors.js';
import type { EngineOutput } from './engine.js';
import { PoolError, type CallRequest } from './pool.js';
import {
  chatToolCall,
  completeToolCalls,
  isObj,
  joinText,
  passThrough,
  refuse,
  sse,
  toolCallId,
  usageCounts,
  type ApiWriter,
  type CallMeta,
  type Obj,
  type Translated,
} from './translate.js';

/** The prefix of the ids given to tool calls that came from the engine without one. */
const CALL_ID_PREFIX = 'call_';

const LOGPROBS_INCLUDE = 'message.output_text.logprobs';

/** Fields read here; the others go to the engine's chat completions as they are (e.g. vLLM's top_k). */
const HANDLED = new Set([
  'model',
  'input',
  'instructions',
  'tools',
  'tool_choice',
  'max_output_tokens',
  'stream',
  'stream_options',
  'text',
  'reasoning',
  'include',
  'top_logprobs',
  'store',
  'metadata',
  'truncation',
  'previous_response_id',
  'conversation',
  'prompt',
  'background',
  'max_tool_calls',
  'parallel_tool_calls',
  'temperature',
  'top_p',
  'user',
  'service_tier',
  'safety_identifier',
  'prompt_cache_key',
]);

/** Fields whose meaning needs state or services the gateway does not have. */
const REFUSED: Record<string, string> = {
  previous_response_id:
    'the gateway stores no responses: send the whole conversation as input items (the OpenAI Agents SDK does by default)',
  conversation: 'the gateway stores no conversations: send the whole conversation as input items',
  prompt: 'stored prompt templates are not available through the gateway: send instructions and input',
  background: 'background responses need stored responses, which the gateway does not keep',
  max_tool_calls: 'applies to built-in tools, which the gateway does not run',
};

const TEXT_PARTS = ['input_text', 'output_text', 'text'];

type Msg = Obj & { role: string };

/** Translates a Responses request into the chat call it is recorded as. */
export function responsesRequest(body: unknown): Translated {
  if (!isObj(body)) throw new PoolError(400, `request body: expected a JSON object, got ${describeValue(body)}`);
  for (const [f, why] of Object.entries(REFUSED)) if (body[f] !== undefined && body[f] !== null) throw refuse(f, why);
  if (body.stream !== undefined && body.stream !== null && typeof body.stream !== 'boolean')
    throw refuse('stream', `expected true or false, got ${describeValue(body.stream)}`);
  if (body.truncation !== undefined && body.truncation !== null && body.truncation !== 'disabled')
    throw refuse('truncation', `the gateway does not truncate context: expected "disabled", got ${describeValue(body.truncation)}`);
  const include = body.include ?? [];
  if (!Array.isArray(include)) throw refuse('include', `expected a list, got ${describeValue(include)}`);
  include.forEach((x, i) => {
    if (x !== LOGPROBS_INCLUDE)
      throw refuse(`include[${i}]`, `only ${JSON.stringify(LOGPROBS_INCLUDE)} is available through the gateway, got ${describeValue(x)}`);
  });
  const messages: Msg[] = [];
  if (body.instructions !== undefined && body.instructions !== null) {
    if (typeof body.instructions !== 'string') throw refuse('instructions', `expected a string, got ${describeValue(body.instructions)}`);
    messages.push({ role: 'system', content: body.instructions });
  }
  messages.push(...inputMessages(body.input));
  const chat: Obj = { ...passThrough(body, HANDLED), messages };
  for (const f of ['model', 'temperature', 'top_p', 'user', 'parallel_tool_calls', 'stream'] as const)
    if (body[f] !== undefined && body[f] !== null) chat[f] = body[f];
  if (body.max_output_tokens !== undefined && body.max_output_tokens !== null) chat.max_tokens = body.max_output_tokens;
  const tools = chatTools(body.tools);
  if (tools.length) chat.tools = tools;
  if (body.tool_choice !== undefined && body.tool_choice !== null) chat.tool_choice = toolChoice(body.tool_choice);
  if (body.text !== undefined && body.text !== null && !isObj(body.text))
    throw refuse('text', `expected {"format": …}, got ${describeValue(body.text)}`);
  const { format, ...textRest } = body.text ?? {};
  for (const [k, v] of Object.entries(textRest))
    if (v !== undefined && v !== null) throw refuse(`text.${k}`, 'not available through the gateway (text.format only)');
  if (format !== undefined && format !== null) chat.response_format = responseFormat(format);
  if (body.reasoning !== undefined && body.reasoning !== null) {
    if (!isObj(body.reasoning)) throw refuse('reasoning', `expected an object, got ${describeValue(body.reasoning)}`);
    const { effort, summary, generate_summary, ...rest } = body.reasoning;
    const other = Object.keys(rest)[0];
    if (other !== undefined) throw refuse(`reasoning.${other}`, 'not available through the gateway (reasoning.effort only)');
    if ((summary ?? generate_summary ?? null) !== null)
      throw refuse('reasoning.summary', "the gateway returns the engine's reasoning text as it is, not a summary: leave summary out");
    if (effort !== undefined && effort !== null) chat.reasoning_effort = effort;
  }
  const logprobs = include.length > 0;
  if (logprobs) {
    chat.logprobs = true;
    if (body.top_logprobs !== undefined && body.top_logprobs !== null) chat.top_logprobs = body.top_logprobs;
  } else if (body.top_logprobs !== undefined && body.top_logprobs !== null && body.top_logprobs !== 0) {
    throw refuse('top_logprobs', `needs include: [${JSON.stringify(LOGPROBS_INCLUDE)}] to be returned`);
  }
  const request: CallRequest = { messages };
  if (tools.length) request.tools = tools;
  const echo = {
    instructions: body.instructions ?? null,
    max_output_tokens: body.max_output_tokens ?? null,
    model: body.model ?? null,
    parallel_tool_calls: body.parallel_tool_calls ?? true,
    temperature: body.temperature ?? null,
    tool_choice: body.tool_choice ?? 'auto',
    tools: body.tools ?? [],
    top_p: body.top_p ?? null,
    text: body.text ?? { format: { type: 'text' } },
    reasoning: { effort: (isObj(body.reasoning) ? body.reasoning.effort : undefined) ?? null, summary: null },
    metadata: body.metadata ?? {},
    store: body.store ?? true,
    truncation: 'disabled',
    user: body.user ?? null,
    previous_response_id: null,
  };
  return { chat, request, stream: body.stream === true, writer: (call) => new ResponsesWriter(call, echo, logprobs), complete };
}

/**
 * The output as recorded: tool call ids as the writer names them, and the empty text that comes with tool calls as
 * no text (no message item carries it, so the client sends the turn back without one; vLLM renders both alike).
 */
function complete(o: EngineOutput, call: CallMeta): void {
  completeToolCalls(o, CALL_ID_PREFIX, call.id);
  if (o.message?.content === '' && o.message.tool_calls?.length) o.message.content = null;
}

function inputMessages(input: unknown): Msg[] {
  if (typeof input === 'string') return [{ role: 'user', content: input }];
  if (!Array.isArray(input) || input.length === 0)
    throw refuse('input', `expected a string or a non-empty list of input items, got ${describeValue(input)}`);
  const out: Msg[] = [];
  // Reasoning, an assistant message and function calls in a row are one assistant turn of chat, as the engine
  // produced them (Response output items come in that order).
  let turn: Msg | undefined;
  const assistant = (): Msg => {
    if (!turn) {
      turn = { role: 'assistant', content: null };
      out.push(turn);
    }
    return turn;
  };
  input.forEach((item, i) => {
    const at = `input[${i}]`;
    if (!isObj(item)) throw refuse(at, `expected an input item, got ${describeValue(item)}`);
    const type = item.type ?? 'message';
    if (type === 'message') {
      const role = item.role;
      if (role !== 'user' && role !== 'assistant' && role !== 'system' && role !== 'developer')
        throw refuse(`${at}.role`, `expected user, assistant, system or developer, got ${describeValue(role)}`);
      const content = joinText(item.content, `${at}.content`, [...TEXT_PARTS, 'refusal']);
      if (role === 'assistant') {
        if (turn && (turn.content !== null || turn.tool_calls)) turn = undefined;
        assistant().content = content;
        return;
      }
      turn = undefined;
      // chat templates know system, not developer (the Responses API's name for it)
      out.push({ role: role === 'developer' ? 'system' : role, content });
      return;
    }
    if (type === 'function_call') {
      for (const f of ['call_id', 'name', 'arguments'] as const)
        if (typeof item[f] !== 'string') throw refuse(`${at}.${f}`, `expected a string, got ${describeValue(item[f])}`);
      const t = assistant();
      ((t.tool_calls ??= []) as unknown[]).push(chatToolCall(item.call_id as string, item.name as string, item.arguments as string));
      return;
    }
    if (type === 'reasoning') {
      const text = Array.isArray(item.content) ? joinText(item.content, `${at}.content`, ['reasoning_text']) : undefined;
      if (text === undefined)
        throw refuse(
          `${at}.content`,
          'a reasoning item needs its reasoning text (the gateway cannot read encrypted_content or train on a summary)',
        );
      if (turn && (turn.content !== null || turn.tool_calls || turn.reasoning_content !== undefined)) turn = undefined;
      assistant().reasoning_content = text;
      return;
    }
    turn = undefined;
    if (type === 'function_call_output') {
      if (typeof item.call_id !== 'string') throw refuse(`${at}.call_id`, `expected a string, got ${describeValue(item.call_id)}`);
      out.push({ role: 'tool', tool_call_id: item.call_id, content: joinText(item.output, `${at}.output`, TEXT_PARTS) });
      return;
    }
    if (type === 'item_reference')
      throw refuse(`${at}.type`, 'item references need stored responses, which the gateway does not keep: send the item itself');
    throw refuse(
      `${at}.type`,
      `input items of type ${describeValue(type)} are not supported by the gateway (message, function_call, function_call_output, reasoning); see docs/guides/agent-apis.md`,
    );
  });
  return out;
}

function chatTools(tools: unknown): Obj[] {
  if (tools === undefined || tools === null) return [];
  if (!Array.isArray(tools)) throw refuse('tools', `expected a list of tools, got ${describeValue(tools)}`);
  return tools.map((t, i) => {
    if (!isObj(t)) throw refuse(`tools[${i}]`, `expected a tool, got ${describeValue(t)}`);
    if (t.type !== 'function')
      throw refuse(`tools[${i}].type`, `built-in tools are not run by the gateway: function tools only, got ${describeValue(t.type)}`);
    if (typeof t.name !== 'string') throw refuse(`tools[${i}].name`, `expected a string, got ${describeValue(t.name)}`);
    const fn: Obj = { name: t.name };
    if (t.description !== undefined && t.description !== null) fn.description = t.description;
    if (t.parameters !== undefined && t.parameters !== null) fn.parameters = t.parameters;
    if (t.strict !== undefined && t.strict !== null) fn.strict = t.strict;
    return { type: 'function', function: fn };
  });
}

function toolChoice(c: unknown): unknown {
  if (c === 'auto' || c === 'none' || c === 'required') return c;
  if (isObj(c) && c.type === 'function' && typeof c.name === 'string') return { type: 'function', function: { name: c.name } };
  throw refuse(
    'tool_choice',
    `expected "auto", "none", "required" or {"type": "function", "name": …} (built-in and allowed-tools choices are not supported), got ${describeValue(c)}`,
  );
}

function responseFormat(f: unknown): unknown {
  if (!isObj(f)) throw refuse('text.format', `expected an object, got ${describeValue(f)}`);
  if (f.type === 'text') return { type: 'text' };
  if (f.type === 'json_object') return { type: 'json_object' };
  if (f.type === 'json_schema') {
    const schema: Obj = { name: f.name, schema: f.schema };
    if (f.description !== undefined) schema.description = f.description;
    if (f.strict !== undefined) schema.strict = f.strict;
    return { type: 'json_schema', json_schema: schema };
  }
  throw refuse('text.format.type', `expected text, json_object or json_schema, got ${describeValue(f.type)}`);
}

interface Item {
  item: Obj;
  /** SSE events that close it */
  close(): string;
}

/** A chat stream as Response events; the whole output as a Response. */
class ResponsesWriter implements ApiWriter {
  private seq = 0;
  private started = false;
  private readonly output: Obj[] = [];
  private open: { key: string; item: Item } | undefined;
  private readonly toolItems = new Map<number, Obj>();
  private finish: string | null = null;
  private usage: unknown;
  private promptIds = 0;
  private outputIds = 0;
  private readonly id: string;

  constructor(
    private readonly call: CallMeta,
    private readonly echo: Obj,
    /** the client asked for logprobs (include) */
    private readonly logprobs: boolean,
  ) {
    this.id = `resp_${call.id}`;
  }

  private ev(type: string, data: Obj): string {
    return sse(type, { type, sequence_number: this.seq++, ...data });
  }

  private response(status: string): Obj {
    const r: Obj = {
      id: this.id,
      object: 'response',
      created_at: Math.floor(this.call.time / 1000),
      status,
      error: null,
      incomplete_details: null,
      ...this.echo,
      output: status === 'in_progress' ? [] : this.output,
    };
    if (status === 'incomplete')
      r.incomplete_details = { reason: this.finish === 'content_filter' ? 'content_filter' : 'max_output_tokens' };
    if (status !== 'in_progress') {
      const u = usageCounts(this.usage, this.promptIds, this.outputIds);
      r.usage = {
        input_tokens: u.input,
        input_tokens_details: { cached_tokens: 0 },
        output_tokens: u.output,
        output_tokens_details: { reasoning_tokens: 0 },
        total_tokens: u.input + u.output,
      };
    }
    return r;
  }

  private status(): string {
    return this.finish === 'length' || this.finish === 'content_filter' ? 'incomplete' : 'completed';
  }

  private start(): string {
    if (this.started) return '';
    this.started = true;
    return (
      this.ev('response.created', { response: this.response('in_progress') }) +
      this.ev('response.in_progress', { response: this.response('in_progress') })
    );
  }

  /** Opens the output item `key` (closing the one open), or continues it. */
  private item(key: string, make: () => Item, opened: (item: Obj) => string): { text: string; item: Obj } {
    if (this.open?.key === key) return { text: '', item: this.open.item.item };
    let text = this.closeOpen();
    const it = make();
    this.output.push(it.item);
    this.open = { key, item: it };
    text += this.ev('response.output_item.added', {
      output_index: this.output.length - 1,
      item: { ...it.item, content: Array.isArray(it.item.content) ? [] : it.item.content },
    });
    text += opened(it.item);
    return { text, item: it.item };
  }

  private closeOpen(): string {
    const text = this.open?.item.close() ?? '';
    this.open = undefined;
    return text;
  }

  chunk(chunk: Obj): string {
    let text = this.start();
    if (Array.isArray(chunk.prompt_token_ids)) this.promptIds = chunk.prompt_token_ids.length;
    if (chunk.usage !== undefined && chunk.usage !== null) this.usage = chunk.usage;
    const c = Array.isArray(chunk.choices) ? (chunk.choices.find((x) => isObj(x) && (x.index ?? 0) === 0) as Obj | undefined) : undefined;
    if (!c) return text;
    if (Array.isArray(c.token_ids)) this.outputIds += c.token_ids.length;
    if (typeof c.finish_reason === 'string') this.finish = c.finish_reason;
    const d = isObj(c.delta) ? c.delta : {};
    const reasoning = d.reasoning_content ?? d.reasoning;
    if (typeof reasoning === 'string' && reasoning !== '') text += this.reasoningDelta(reasoning);
    const lp = this.logprobs && isObj(c.logprobs) && Array.isArray(c.logprobs.content) ? c.logprobs.content.map(logprob) : [];
    if (typeof d.content === 'string') text += this.textDelta(d.content, lp);
    if (Array.isArray(d.tool_calls)) for (const tc of d.tool_calls) if (isObj(tc)) text += this.toolDelta(tc);
    return text;
  }

  private reasoningDelta(delta: string): string {
    const index = () => this.output.length - 1;
    const { text, item } = this.item(
      'reasoning',
      () => {
        const item: Obj = {
          id: `rs_${this.call.id}_${this.output.length}`,
          type: 'reasoning',
          summary: [],
          content: [{ type: 'reasoning_text', text: '' }],
        };
        return {
          item,
          close: () => {
            const part = (item.content as Obj[])[0];
            const at = this.output.indexOf(item);
            return (
              this.ev('response.reasoning_text.done', { item_id: item.id, output_index: at, content_index: 0, text: part.text }) +
              this.ev('response.content_part.done', { item_id: item.id, output_index: at, content_index: 0, part }) +
              this.ev('response.output_item.done', { output_index: at, item })
            );
          },
        };
      },
      (item) =>
        this.ev('response.content_part.added', {
          item_id: item.id,
          output_index: index(),
          content_index: 0,
          part: { type: 'reasoning_text', text: '' },
        }),
    );
    const part = (item.content as Obj[])[0];
    part.text = (part.text as string) + delta;
    return (
      text +
      this.ev('response.reasoning_text.delta', { item_id: item.id, output_index: this.output.indexOf(item), content_index: 0, delta })
    );
  }

  private textDelta(delta: string, logprobs: Obj[], force = false): string {
    // vLLM opens a stream with empty text, tool calls or not: an empty message item only where nothing else comes
    if (delta === '' && !force && this.open?.key !== 'message') return '';
    const { text, item } = this.item(
      'message',
      () => {
        const item: Obj = {
          id: `msg_${this.call.id}_${this.output.length}`,
          type: 'message',
          status: 'in_progress',
          role: 'assistant',
          content: [{ type: 'output_text', text: '', annotations: [], logprobs: [] }],
        };
        return {
          item,
          close: () => {
            const part = (item.content as Obj[])[0];
            const at = this.output.indexOf(item);
            item.status = 'completed';
            return (
              this.ev('response.output_text.done', {
                item_id: item.id,
                output_index: at,
                content_index: 0,
                text: part.text,
                logprobs: part.logprobs,
              }) +
              this.ev('response.content_part.done', { item_id: item.id, output_index: at, content_index: 0, part }) +
              this.ev('response.output_item.done', { output_index: at, item })
            );
          },
        };
      },
      (item) =>
        this.ev('response.content_part.added', {
          item_id: item.id,
          output_index: this.output.length - 1,
          content_index: 0,
          part: { type: 'output_text', text: '', annotations: [], logprobs: [] },
        }),
    );
    const part = (item.content as Obj[])[0];
    part.text = (part.text as string) + delta;
    (part.logprobs as Obj[]).push(...logprobs);
    return (
      text +
      this.ev('response.output_text.delta', {
        item_id: item.id,
        output_index: this.output.indexOf(item),
        content_index: 0,
        delta,
        logprobs,
      })
    );
  }

  private toolDelta(tc: Obj): string {
    const index = Number.isSafeInteger(tc.index) ? (tc.index as number) : this.toolItems.size;
    const fn = isObj(tc.function) ? tc.function : {};
    const { text, item } = this.item(
      `tool:${index}`,
      () => {
        const item: Obj = {
          id: `fc_${this.call.id}_${this.output.length}`,
          type: 'function_call',
          status: 'in_progress',
          call_id: typeof tc.id === 'string' ? tc.id : toolCallId(CALL_ID_PREFIX, this.call.id, index),
          name: '',
          arguments: '',
        };
        this.toolItems.set(index, item);
        return {
          item,
          close: () => {
            const at = this.output.indexOf(item);
            item.status = 'completed';
            return (
              this.ev('response.function_call_arguments.done', {
                item_id: item.id,
                output_index: at,
                name: item.name,
                arguments: item.arguments,
              }) + this.ev('response.output_item.done', { output_index: at, item })
            );
          },
        };
      },
      () => '',
    );
    if (typeof fn.name === 'string') item.name = (item.name as string) + fn.name;
    if (typeof fn.arguments !== 'string' || fn.arguments === '') return text;
    item.arguments = (item.arguments as string) + fn.arguments;
    return (
      text +
      this.ev('response.function_call_arguments.delta', { item_id: item.id, output_index: this.output.indexOf(item), delta: fn.arguments })
    );
  }

  /** Closes the last item; an answer of empty text and nothing else is an empty message (sent back as a turn). */
  private closeOutput(): string {
    return (this.output.length === 0 ? this.textDelta('', [], true) : '') + this.closeOpen();
  }

  end(): string {
    const text = this.start() + this.closeOutput();
    const status = this.status();
    return text + this.ev(status === 'completed' ? 'response.completed' : 'response.incomplete', { response: this.response(status) });
  }

  fail(message: string): string {
    return this.start() + this.ev('error', { code: 'engine_error', message, param: null });
  }

  answer(): Obj {
    this.closeOutput();
    return this.response(this.status());
  }
}

/** A chat logprob entry as a Responses one (bytes and top_logprobs always lists). */
function logprob(e: unknown): Obj {
  const x = isObj(e) ? e : {};
  const top = Array.isArray(x.top_logprobs)
    ? x.top_logprobs.filter(isObj).map((t) => ({ token: t.token, logprob: t.logprob, bytes: t.bytes ?? [] }))
    : [];
  return { token: x.token ?? '', logprob: x.logprob, bytes: x.bytes ?? [], top_logprobs: top };
}
