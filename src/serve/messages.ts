/**
 * The Anthropic Messages API (`POST /v1/messages`) on the engine's chat completions: `system` and the messages'
 * content blocks become chat messages (text: content; tool_use: an assistant tool call; tool_result: a tool
 * message; thinking: the assistant's reasoning_content), custom tools chat tools; the engine's chat answer
 * becomes a Message with thinking, text and tool_use blocks, or its SSE events (message_start … message_stop).
 * Server tools (web search, code execution, …), images, documents and extended-thinking budgets are refused.
 * `messagesPrompt` is the same translation for `/v1/messages/count_tokens`.
 */
import { describeValue } from '../errors.js';
import type { EngineOutput, ToolCallOut } from './engine.js';
import { PoolError, jsonEqual, type CallRequest } from './pool.js';
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
const TOOL_USE_ID_PREFIX = 'toolu_';

/** Fields read here; the others go to the engine's chat completions as they are. */
const HANDLED = new Set([
  'model',
  'messages',
  'system',
  'max_tokens',
  'tools',
  'tool_choice',
  'stop_sequences',
  'stream',
  'temperature',
  'top_p',
  'top_k',
  'metadata',
  'thinking',
  'service_tier',
  'container',
  'mcp_servers',
  'context_management',
]);

const REFUSED: Record<string, string> = {
  container: 'containers belong to server tools, which the gateway does not run',
  mcp_servers: 'the gateway runs no MCP connector: give the tools as custom tools',
  context_management: 'the gateway does not edit context: send the messages to use',
};

type Msg = Obj & { role: string };

/**
 * Translates a Messages request into the chat call it is recorded as. `prior` holds the episode's recorded tool
 * calls by id: a tool_use block sent back carries its input as an object, and where that object is the one a
 * recorded call's arguments parse to, the arguments text the engine generated is kept, so the turn is recorded as
 * the engine produced it.
 */
export function messagesRequest(body: unknown, prior: ReadonlyMap<string, ToolCallOut>): Translated {
  const b = requestBody(body);
  if (b.stream !== undefined && b.stream !== null && typeof b.stream !== 'boolean')
    throw refuse('stream', `expected true or false, got ${describeValue(b.stream)}`);
  if (!Number.isSafeInteger(b.max_tokens) || (b.max_tokens as number) < 1)
    throw refuse('max_tokens', `expected an integer >= 1, got ${describeValue(b.max_tokens)}`);
  const { request, choice } = conversation(b, prior);
  const chat: Obj = { ...passThrough(b, HANDLED), messages: request.messages, max_tokens: b.max_tokens };
  for (const f of ['model', 'temperature', 'top_p', 'top_k', 'stream'] as const) if (b[f] !== undefined && b[f] !== null) chat[f] = b[f];
  if (b.stop_sequences !== undefined && b.stop_sequences !== null) chat.stop = b.stop_sequences;
  if (isObj(b.metadata) && typeof b.metadata.user_id === 'string') chat.user = b.metadata.user_id;
  if (request.tools) chat.tools = request.tools;
  Object.assign(chat, choice);
  const stops = Array.isArray(b.stop_sequences) ? (b.stop_sequences as unknown[]) : [];
  return { chat, request, stream: b.stream === true, writer: (call) => new MessagesWriter(call, b.model ?? null, stops), complete };
}

/**
 * Request fields a count refuses: the engine renders its prompt another way with them than the service's chat
 * template with its generation prompt, so the count would not be the engine's.
 */
const UNCOUNTED: Record<string, string> = {
  chat_template: "the count renders the service's --tokenizer chat template, not one sent with the request",
  add_generation_prompt: 'the count renders the generation prompt, as a call does',
  continue_final_message: 'the count renders the generation prompt after the last message, as a call does',
};

/**
 * The prompt of a Messages request as `/v1/messages/count_tokens` receives it (no max_tokens or stream): the
 * chat messages and tools `messagesRequest` records for it, refused where it refuses them, and the engine's
 * `chat_template_kwargs` (template variables), which a call passes to the engine.
 */
export function messagesPrompt(
  body: unknown,
  prior: ReadonlyMap<string, ToolCallOut>,
): { request: CallRequest; templateVars: Obj | undefined } {
  const b = requestBody(body);
  for (const [f, why] of Object.entries(UNCOUNTED)) if (b[f] !== undefined && b[f] !== null) throw refuse(f, why);
  const vars = b.chat_template_kwargs;
  if (vars !== undefined && vars !== null && !isObj(vars))
    throw refuse('chat_template_kwargs', `expected an object of template variables, got ${describeValue(vars)}`);
  return { request: conversation(b, prior).request, templateVars: isObj(vars) ? vars : undefined };
}

/** The body as an object, with the fields refused whatever the route. */
function requestBody(body: unknown): Obj {
  if (!isObj(body)) throw new PoolError(400, `request body: expected a JSON object, got ${describeValue(body)}`);
  for (const [f, why] of Object.entries(REFUSED)) if (body[f] !== undefined && body[f] !== null) throw refuse(f, why);
  if (isObj(body.thinking) && body.thinking.type === 'enabled') {
    throw refuse(
      'thinking',
      'a thinking budget has no chat-completions counterpart: leave thinking out (or {"type": "disabled"}) and turn the engine\'s reasoning on through its own parameters (e.g. chat_template_kwargs)',
    );
  }
  return body;
}

/** `system`, the messages and the tools as chat messages and tools (what is recorded), and the chat tool choice. */
function conversation(body: Obj, prior: ReadonlyMap<string, ToolCallOut>): { request: CallRequest; choice: Obj } {
  const messages: Msg[] = [];
  if (body.system !== undefined && body.system !== null)
    messages.push({ role: 'system', content: joinText(body.system, 'system', ['text']) });
  if (!Array.isArray(body.messages) || body.messages.length === 0)
    throw refuse('messages', `expected a non-empty list of messages, got ${describeValue(body.messages)}`);
  body.messages.forEach((m, i) => messages.push(...chatMessages(m, `messages[${i}]`, prior)));
  const tools = chatTools(body.tools);
  const choice = body.tool_choice !== undefined && body.tool_choice !== null ? toolChoice(body.tool_choice) : {};
  const request: CallRequest = { messages };
  if (tools.length) request.tools = tools;
  return { request, choice };
}

/**
 * The output as recorded: tool call ids as the writer names them, and empty text as no text (a Message has no
 * empty text block, so the client sends the turn back without one; vLLM renders both alike).
 */
function complete(o: EngineOutput, call: CallMeta): void {
  completeToolCalls(o, TOOL_USE_ID_PREFIX, call.id);
  if (o.message?.content === '') o.message.content = null;
}

function chatMessages(m: unknown, at: string, prior: ReadonlyMap<string, ToolCallOut>): Msg[] {
  if (!isObj(m)) throw refuse(at, `expected a message, got ${describeValue(m)}`);
  if (m.role !== 'user' && m.role !== 'assistant') throw refuse(`${at}.role`, `expected user or assistant, got ${describeValue(m.role)}`);
  if (typeof m.content === 'string') return [{ role: m.role, content: m.content }];
  if (!Array.isArray(m.content))
    throw refuse(`${at}.content`, `expected a string or a list of content blocks, got ${describeValue(m.content)}`);
  const blocks = m.content.map((b, i) => {
    if (!isObj(b) || typeof b.type !== 'string')
      throw refuse(`${at}.content[${i}]`, `expected a content block with a type, got ${describeValue(b)}`);
    return b;
  });
  const field = (i: number, f: string) => `${at}.content[${i}].${f}`;
  if (m.role === 'assistant') {
    const turn: Msg = { role: 'assistant', content: null };
    const text: string[] = [];
    const calls: ToolCallOut[] = [];
    blocks.forEach((b, i) => {
      if (b.type === 'text') text.push(stringField(b, 'text', field(i, 'text')));
      else if (b.type === 'thinking')
        turn.reasoning_content = ((turn.reasoning_content as string | undefined) ?? '') + stringField(b, 'thinking', field(i, 'thinking'));
      else if (b.type === 'tool_use') {
        const id = stringField(b, 'id', field(i, 'id'));
        const name = stringField(b, 'name', field(i, 'name'));
        if (!isObj(b.input)) throw refuse(field(i, 'input'), `expected an object, got ${describeValue(b.input)}`);
        calls.push(chatToolCall(id, name, argumentsText(b.input, prior.get(id))));
      } else
        throw refuse(
          field(i, 'type'),
          `assistant content of type ${JSON.stringify(b.type)} is not supported by the gateway (text, thinking, tool_use); see docs/guides/agent-apis.md`,
        );
    });
    if (text.length) turn.content = text.join('\n');
    if (calls.length) turn.tool_calls = calls;
    return [turn];
  }
  // A user turn: tool results become tool messages, text between them user messages, in order.
  const out: Msg[] = [];
  let text: string[] = [];
  const flush = () => {
    if (text.length) out.push({ role: 'user', content: text.join('\n') });
    text = [];
  };
  blocks.forEach((b, i) => {
    if (b.type === 'text') text.push(stringField(b, 'text', field(i, 'text')));
    else if (b.type === 'tool_result') {
      flush();
      const id = stringField(b, 'tool_use_id', field(i, 'tool_use_id'));
      // is_error has no chat counterpart: the tool message holds the result's text (docs/guides/agent-apis.md)
      out.push({
        role: 'tool',
        tool_call_id: id,
        content: b.content === undefined ? '' : joinText(b.content, field(i, 'content'), ['text']),
      });
    } else
      throw refuse(
        field(i, 'type'),
        `user content of type ${JSON.stringify(b.type)} is not supported by the gateway (text, tool_result); see docs/guides/agent-apis.md`,
      );
  });
  flush();
  return out;
}

function stringField(b: Obj, f: string, field: string): string {
  if (typeof b[f] !== 'string') throw refuse(field, `expected a string, got ${describeValue(b[f])}`);
  return b[f];
}

/** The arguments text of a tool_use block's input: the engine's own text where it parses to this input. */
function argumentsText(input: Obj, recorded: ToolCallOut | undefined): string {
  if (recorded) {
    try {
      if (jsonEqual(JSON.parse(recorded.function.arguments), input)) return recorded.function.arguments;
    } catch {
      // not JSON: the client's input stands
    }
  }
  return JSON.stringify(input);
}

function chatTools(tools: unknown): Obj[] {
  if (tools === undefined || tools === null) return [];
  if (!Array.isArray(tools)) throw refuse('tools', `expected a list of tools, got ${describeValue(tools)}`);
  return tools.map((t, i) => {
    if (!isObj(t)) throw refuse(`tools[${i}]`, `expected a tool, got ${describeValue(t)}`);
    if (t.type !== undefined && t.type !== null && t.type !== 'custom')
      throw refuse(
        `tools[${i}].type`,
        `server and Anthropic-defined tools are not run by the gateway: custom tools only (an input_schema, no type), got ${describeValue(t.type)}`,
      );
    if (typeof t.name !== 'string') throw refuse(`tools[${i}].name`, `expected a string, got ${describeValue(t.name)}`);
    if (!isObj(t.input_schema))
      throw refuse(`tools[${i}].input_schema`, `expected a JSON schema object, got ${describeValue(t.input_schema)}`);
    const fn: Obj = { name: t.name };
    if (typeof t.description === 'string') fn.description = t.description;
    fn.parameters = t.input_schema;
    return { type: 'function', function: fn };
  });
}

function toolChoice(c: unknown): Obj {
  if (!isObj(c)) throw refuse('tool_choice', `expected {"type": "auto" | "any" | "tool" | "none"}, got ${describeValue(c)}`);
  const out: Obj = {};
  if (c.type === 'auto') out.tool_choice = 'auto';
  else if (c.type === 'any') out.tool_choice = 'required';
  else if (c.type === 'none') out.tool_choice = 'none';
  else if (c.type === 'tool' && typeof c.name === 'string') out.tool_choice = { type: 'function', function: { name: c.name } };
  else throw refuse('tool_choice', `expected {"type": "auto" | "any" | "tool" (with a name) | "none"}, got ${describeValue(c)}`);
  if (c.disable_parallel_tool_use === true) out.parallel_tool_calls = false;
  return out;
}

interface Block {
  block: Obj;
  /** the tool_use input's text so far */
  json?: string;
}

/** A chat stream as Messages events; the whole output as a Message. */
class MessagesWriter implements ApiWriter {
  private started = false;
  private readonly blocks: Block[] = [];
  private open: { key: string; block: Block } | undefined;
  private finish: string | null = null;
  private stopReason: unknown;
  private usage: unknown;
  private promptIds = 0;
  private outputIds = 0;

  constructor(
    private readonly call: CallMeta,
    private readonly model: unknown,
    private readonly stops: readonly unknown[],
  ) {}

  private message(): Obj {
    return {
      id: `msg_${this.call.id}`,
      type: 'message',
      role: 'assistant',
      model: this.model,
      content: [],
      stop_reason: null,
      stop_sequence: null,
      usage: { input_tokens: this.promptIds, output_tokens: 0 },
    };
  }

  chunk(chunk: Obj): string {
    if (Array.isArray(chunk.prompt_token_ids)) this.promptIds = chunk.prompt_token_ids.length;
    if (chunk.usage !== undefined && chunk.usage !== null) this.usage = chunk.usage;
    let text = '';
    if (!this.started) {
      this.started = true;
      text += sse('message_start', { type: 'message_start', message: this.message() });
    }
    const c = Array.isArray(chunk.choices) ? (chunk.choices.find((x) => isObj(x) && (x.index ?? 0) === 0) as Obj | undefined) : undefined;
    if (!c) return text;
    if (Array.isArray(c.token_ids)) this.outputIds += c.token_ids.length;
    if (typeof c.finish_reason === 'string') this.finish = c.finish_reason;
    if (c.stop_reason !== undefined && c.stop_reason !== null) this.stopReason = c.stop_reason;
    const d = isObj(c.delta) ? c.delta : {};
    const reasoning = d.reasoning_content ?? d.reasoning;
    if (typeof reasoning === 'string' && reasoning !== '') {
      text += this.delta(
        'thinking',
        () => ({ type: 'thinking', thinking: '', signature: '' }),
        (b) => {
          b.block.thinking = (b.block.thinking as string) + reasoning;
          return { type: 'thinking_delta', thinking: reasoning };
        },
      );
    }
    const content = d.content;
    if (typeof content === 'string' && content !== '') {
      text += this.delta(
        'text',
        () => ({ type: 'text', text: '' }),
        (b) => {
          b.block.text = (b.block.text as string) + content;
          return { type: 'text_delta', text: content };
        },
      );
    }
    if (Array.isArray(d.tool_calls)) {
      for (const tc of d.tool_calls) {
        if (!isObj(tc)) continue;
        const index = Number.isSafeInteger(tc.index) ? (tc.index as number) : 0;
        const fn = isObj(tc.function) ? tc.function : {};
        const args = typeof fn.arguments === 'string' ? fn.arguments : '';
        text += this.delta(
          `tool:${index}`,
          () => ({
            type: 'tool_use',
            id: typeof tc.id === 'string' ? tc.id : toolCallId(TOOL_USE_ID_PREFIX, this.call.id, index),
            name: typeof fn.name === 'string' ? fn.name : '',
            input: {},
          }),
          (b) => {
            b.json = (b.json ?? '') + args;
            return args === '' ? undefined : { type: 'input_json_delta', partial_json: args };
          },
        );
      }
    }
    return text;
  }

  /** Opens block `key` (closing the one open) or continues it, and sends what `add` returns as its delta. */
  private delta(key: string, make: () => Obj, add: (b: Block) => Obj | undefined): string {
    let text = '';
    if (this.open?.key !== key) {
      text += this.closeOpen();
      const b: Block = { block: make() };
      this.blocks.push(b);
      this.open = { key, block: b };
      const start = b.block.type === 'tool_use' ? { ...b.block, input: {} } : { ...b.block };
      text += sse('content_block_start', { type: 'content_block_start', index: this.blocks.length - 1, content_block: start });
    }
    const d = add(this.open.block);
    if (d) text += sse('content_block_delta', { type: 'content_block_delta', index: this.blocks.length - 1, delta: d });
    return text;
  }

  private closeOpen(): string {
    if (!this.open) return '';
    const b = this.open.block;
    this.open = undefined;
    if (b.block.type === 'tool_use') b.block.input = toolInput(b.json ?? '', this.blocks.indexOf(b));
    return sse('content_block_stop', { type: 'content_block_stop', index: this.blocks.indexOf(b) });
  }

  private stop(): { stop_reason: string; stop_sequence: string | null } {
    if (this.finish === 'length') return { stop_reason: 'max_tokens', stop_sequence: null };
    if (this.blocks.some((b) => b.block.type === 'tool_use')) return { stop_reason: 'tool_use', stop_sequence: null };
    // vLLM names the stop string that ended the text in `stop_reason`
    if (typeof this.stopReason === 'string' && this.stops.includes(this.stopReason))
      return { stop_reason: 'stop_sequence', stop_sequence: this.stopReason };
    if (this.finish === 'content_filter') return { stop_reason: 'refusal', stop_sequence: null };
    return { stop_reason: 'end_turn', stop_sequence: null };
  }

  end(): string {
    let text = this.started ? '' : sse('message_start', { type: 'message_start', message: this.message() });
    this.started = true;
    text += this.closeOpen();
    const u = usageCounts(this.usage, this.promptIds, this.outputIds);
    text += sse('message_delta', { type: 'message_delta', delta: this.stop(), usage: { input_tokens: u.input, output_tokens: u.output } });
    return text + sse('message_stop', { type: 'message_stop' });
  }

  fail(message: string): string {
    return sse('error', { type: 'error', error: { type: 'api_error', message } });
  }

  answer(): Obj {
    this.closeOpen();
    const u = usageCounts(this.usage, this.promptIds, this.outputIds);
    return {
      ...this.message(),
      content: this.blocks.map((b) => b.block),
      ...this.stop(),
      usage: { input_tokens: u.input, output_tokens: u.output },
    };
  }
}

/** A tool call's arguments as a tool_use input: a JSON object, or a 502 (a Message cannot carry other text). */
function toolInput(args: string, index: number): Obj {
  if (args.trim() === '') return {};
  let v: unknown;
  try {
    v = JSON.parse(args);
  } catch {
    v = undefined;
  }
  if (!isObj(v))
    throw new PoolError(
      502,
      `the engine's tool call ${index} has arguments that are not a JSON object (${describeValue(args)}): a tool_use block needs an object input`,
    );
  return v;
}
