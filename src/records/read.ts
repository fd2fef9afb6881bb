/**
 * Record readers: one JSONL stream in, TrainRecords out, the format detected per line so files may mix them.
 * Every rejection is an E_INPUT TreepackError naming file, line, record and field, because the data sets this
 * reads are too large to debug by eye.
 */
import nodePath from 'node:path';
import { TreepackError, describeValue } from '../errors.js';
import { ImageInputError, loadImage, type DecodedImage } from './images.js';
import { EpisodeIds } from './episode-ids.js';
import { readJsonlLines, inputName, type JsonlInput } from './jsonl.js';
import { parseRoutes } from './routes.js';
import {
  AUTHORS,
  type Author,
  type ChatMessage,
  type ChatRecord,
  type ContentPart,
  type Sample,
  type Source,
  type ToolCall,
  type TrainRecord,
} from './types.js';

export interface ReadStats {
  lines: number; // non-blank lines parsed
  records: number; // records yielded (an episode line yields one per request)
}

export interface ReadOptions {
  /** Reject token ids ≥ vocabSize in pre-tokenized records. */
  vocabSize?: number;
  /** Counters updated in place as the generator advances. */
  stats?: ReadStats;
  /** Name used in errors and default ids for a Readable input. */
  name?: string;
  maxLineBytes?: number;
  /** Read invalid UTF-8 as U+FFFD instead of rejecting the line (see JsonlOptions.lossyUtf8). */
  lossyUtf8?: boolean;
  /**
   * Episode lines (`requests`) that share an `episode_id` are parts of one episode (e.g. one line per agent).
   * Off by default: two different lines with one id are an error naming both (see episode-ids.ts).
   */
  repeatedEpisodeIds?: boolean;
}

export interface ParseOptions {
  vocabSize?: number;
  /** Id of a record without one; the default `${file}:${line}` (`line-N` for streams) is stable across runs. */
  defaultId?: string;
}

const MAX_TOKEN_ID = 0x7fffffff;
/** Logprobs come from float16/bfloat16 kernels: tiny positive values are rounding, larger ones a bug upstream. */
const LOGPROB_TOLERANCE = 1e-3;

/**
 * The records of JSONL input (a path, `-` for stdin, or a stream), each format detected per line; a bad line throws
 * E_INPUT naming file, line and field.
 */
export async function* readRecords(input: JsonlInput, opts: ReadOptions = {}): AsyncGenerator<TrainRecord> {
  const file = inputName(input, opts.name);
  const named = (typeof input === 'string' && input !== '-') || opts.name !== undefined;
  const stats = opts.stats;
  const episodes = opts.repeatedEpisodeIds ? undefined : new EpisodeIds();
  for await (const { line, text } of readJsonlLines(input, {
    name: opts.name,
    maxLineBytes: opts.maxLineBytes,
    lossyUtf8: opts.lossyUtf8,
  })) {
    if (stats) stats.lines++;
    let value: unknown;
    try {
      value = JSON.parse(text);
    } catch (e) {
      throw new TreepackError('E_INPUT', `malformed JSON: ${(e as Error).message}`, { file, line });
    }
    const parsed = parseRecords(
      value,
      { file, line },
      {
        vocabSize: opts.vocabSize,
        defaultId: named ? `${file}:${line}` : `line-${line}`,
      },
    );
    episodes?.check(value, parsed, text, file, line);
    for (const r of parsed) {
      if (stats) stats.records++;
      yield r;
    }
  }
}

/** Records of one parsed JSONL value; an episode gives one ChatRecord per request. */
export function parseRecords(value: unknown, source: Source, opts: ParseOptions = {}): TrainRecord[] {
  const ctx: Ctx = { file: source.file, line: source.line, record: undefined };
  const defaultId = opts.defaultId ?? `${source.file}:${source.line}`;
  if (!isObject(value)) throw fail(ctx, undefined, `expected a JSON object per line, got ${describeValue(value)}`);
  if ('requests' in value) return parseEpisode(value, ctx, defaultId);
  if ('messages' in value) return [parseChat(value, ctx, '', chatIds(value, ctx, defaultId))];
  if ('tokens' in value) {
    const slime = 'response_length' in value || 'rollout_log_probs' in value;
    return [slime ? parseSlime(value, ctx, defaultId, opts.vocabSize) : parseTokens(value, ctx, defaultId, opts.vocabSize)];
  }
  const keys = Object.keys(value)
    .slice(0, 8)
    .map((k) => JSON.stringify(k));
  throw fail(
    ctx,
    undefined,
    `unknown record format: expected "requests" (episode), "messages" (chat) or "tokens" (pre-tokenized), got keys [${keys.join(', ')}]`,
  );
}

/** Rejects token ids ≥ vocabSize; for samples built elsewhere (the readers check while parsing). */
export function checkVocab(sample: Sample, vocabSize: number): void {
  checkIds(sample.tokens, vocabSize, { file: sample.source.file, line: sample.source.line, record: sample.id }, 'tokens');
}

/**
 * Rejects engine token ids of a chat response ≥ vocabSize: unlike rendered text, they come from outside and
 * would otherwise reach the trainer's embedding lookup unchecked.
 */
export function checkResponseVocab(rec: ChatRecord, vocabSize: number): void {
  const ids = rec.response.token_ids;
  if (ids) checkIds(ids, vocabSize, { file: rec.source.file, line: rec.source.line, record: rec.id }, 'response.token_ids');
}

function checkIds(t: Int32Array, vocabSize: number, ctx: Ctx, field: string): void {
  for (let i = 0; i < t.length; i++) {
    if (t[i] >= vocabSize) throw fail(ctx, `${field}[${i}]`, `token id ${t[i]} is outside the vocabulary (size ${vocabSize})`);
  }
}

interface Ctx {
  file: string;
  line: number;
  record: string | undefined;
}

type Obj = Record<string, unknown>;

function fail(ctx: Ctx, field: string | undefined, msg: string): TreepackError {
  return new TreepackError('E_INPUT', msg, { file: ctx.file, line: ctx.line, record: ctx.record, field });
}

function isObject(v: unknown): v is Obj {
  return typeof v === 'object' && v !== null && !Array.isArray(v);
}

// JSON null on an optional field means "absent": exporters write it for missing values.

function optString(o: Obj, key: string, ctx: Ctx, path: string): string | undefined {
  const v = o[key];
  if (v === undefined || v === null) return undefined;
  if (typeof v !== 'string') throw fail(ctx, path + key, `expected a string, got ${describeValue(v)}`);
  return v;
}

/** Ids and groups: strings, or integers (slime's `index`, numeric task ids) kept as their decimal text. */
function optId(o: Obj, key: string, ctx: Ctx, path = ''): string | undefined {
  const v = o[key];
  if (v === undefined || v === null) return undefined;
  if (typeof v === 'string') return v;
  if (typeof v === 'number' && Number.isInteger(v)) return String(v);
  throw fail(ctx, path + key, `expected a string or integer id, got ${describeValue(v)}`);
}

function optNumber(o: Obj, key: string, ctx: Ctx, path = ''): number | undefined {
  const v = o[key];
  if (v === undefined || v === null) return undefined;
  if (typeof v !== 'number' || !Number.isFinite(v)) throw fail(ctx, path + key, `expected a finite number, got ${describeValue(v)}`);
  return v;
}

function tokenArray(v: unknown, ctx: Ctx, field: string, vocabSize: number | undefined): Int32Array {
  if (!Array.isArray(v)) throw fail(ctx, field, `expected an array of token ids, got ${describeValue(v)}`);
  const n = v.length;
  const out = new Int32Array(n);
  const limit = vocabSize === undefined ? MAX_TOKEN_ID : Math.min(vocabSize - 1, MAX_TOKEN_ID);
  for (let i = 0; i < n; i++) {
    const x: unknown = v[i];
    if (typeof x !== 'number' || !Number.isInteger(x) || x < 0 || x > limit) {
      const why =
        typeof x === 'number' && Number.isInteger(x) && x >= 0 && x <= MAX_TOKEN_ID
          ? `token id ${x} is outside the vocabulary (size ${vocabSize})`
          : `expected a token id (an integer in 0..${MAX_TOKEN_ID}), got ${describeValue(x)}`;
      throw fail(ctx, `${field}[${i}]`, why);
    }
    out[i] = x;
  }
  return out;
}

function checkLength(v: unknown[], expected: number, what: string, ctx: Ctx, field: string): void {
  if (v.length !== expected) throw fail(ctx, field, `expected ${expected} values (${what}), got ${v.length}`);
}

/** 0/1 values written into `out` from `offset`. */
function maskInto(v: unknown, out: Uint8Array, offset: number, what: string, ctx: Ctx, field: string): void {
  if (!Array.isArray(v)) throw fail(ctx, field, `expected an array of 0/1, got ${describeValue(v)}`);
  checkLength(v, out.length - offset, what, ctx, field);
  for (let i = 0; i < v.length; i++) {
    const x: unknown = v[i];
    if (x !== 0 && x !== 1) throw fail(ctx, `${field}[${i}]`, `expected 0 or 1, got ${describeValue(x)}`);
    out[offset + i] = x;
  }
}

/** Finite numbers written into `out` from `offset`; logprobs must also be ≤ 0 (up to rounding). */
function floatsInto(v: unknown, out: Float32Array, offset: number, logprob: boolean, what: string, ctx: Ctx, field: string): void {
  if (!Array.isArray(v)) throw fail(ctx, field, `expected an array of numbers, got ${describeValue(v)}`);
  checkLength(v, out.length - offset, what, ctx, field);
  for (let i = 0; i < v.length; i++) {
    const x: unknown = v[i];
    if (typeof x !== 'number' || !Number.isFinite(x))
      throw fail(ctx, `${field}[${i}]`, `expected a finite number, got ${describeValue(x)}`);
    if (logprob && x > LOGPROB_TOLERANCE)
      throw fail(ctx, `${field}[${i}]`, `a log-probability must be ≤ 0, got ${x} (probabilities instead of logprobs?)`);
    out[offset + i] = x;
    if (!Number.isFinite(out[offset + i])) throw fail(ctx, `${field}[${i}]`, float32Overflow(x));
  }
}

/** The micro-batch stores these fields as float32: a finite JSON number past its range would become ±inf. */
function float32Overflow(x: number): string {
  return `${x} is outside the float32 range (±${FLOAT32_MAX}) the micro-batch stores it in`;
}

const FLOAT32_MAX = 3.4028234663852886e38;

function optFloats(o: Obj, key: string, n: number, logprob: boolean, ctx: Ctx): Float32Array | undefined {
  const v = o[key];
  if (v === undefined || v === null) return undefined;
  const out = new Float32Array(n);
  floatsInto(v, out, 0, logprob, 'one per token', ctx, key);
  return out;
}

function baseSample(o: Obj, ctx: Ctx, id: string, group: string, tokens: Int32Array, loss_mask: Uint8Array): Sample {
  if (tokens.length > 0) loss_mask[0] = 0; // token 0 has no logprob: nothing predicts it
  const s: Sample = {
    kind: 'sample',
    id,
    group,
    episode: optId(o, 'episode', ctx) ?? id,
    tokens,
    loss_mask,
    source: { file: ctx.file, line: ctx.line },
  };
  const reward = optNumber(o, 'reward', ctx);
  if (reward !== undefined) s.reward = reward;
  return s;
}

function parseTokens(o: Obj, ctx: Ctx, defaultId: string, vocabSize: number | undefined): Sample {
  const id = optId(o, 'id', ctx) ?? defaultId;
  ctx.record = id;
  const tokens = tokenArray(o.tokens, ctx, 'tokens', vocabSize);
  const n = tokens.length;
  let loss_mask: Uint8Array;
  if (o.loss_mask === undefined || o.loss_mask === null) loss_mask = new Uint8Array(n).fill(1);
  else maskInto(o.loss_mask, (loss_mask = new Uint8Array(n)), 0, 'one per token', ctx, 'loss_mask');
  const s = baseSample(o, ctx, id, optId(o, 'group', ctx) ?? id, tokens, loss_mask);
  for (const key of ['rollout_logprobs', 'old_logprobs', 'ref_logprobs'] as const) {
    const a = optFloats(o, key, n, true, ctx);
    if (a) s[key] = a;
  }
  const advantages = optFloats(o, 'advantages', n, false, ctx);
  if (advantages) s.advantages = advantages;
  const advantage = optNumber(o, 'advantage', ctx);
  if (advantage !== undefined && !Number.isFinite(Math.fround(advantage))) throw fail(ctx, 'advantage', float32Overflow(advantage));
  if (advantage !== undefined) s.advantage = advantage;
  if (o.routes !== undefined && o.routes !== null) s.routes = parseRoutes(o.routes, n, { file: ctx.file, line: ctx.line, record: id });
  const agent = optString(o, 'agent', ctx, '');
  if (agent !== undefined) s.agent = agent;
  parseMessageBoundaries(o, ctx, s);
  return s;
}

/** `message_offsets` (start of each message, first 0, strictly increasing) and optional `message_authors`. */
function parseMessageBoundaries(o: Obj, ctx: Ctx, s: Sample): void {
  if (o.message_offsets === undefined || o.message_offsets === null) {
    if (o.message_authors !== undefined && o.message_authors !== null)
      throw fail(ctx, 'message_authors', 'message_authors needs message_offsets (where each message starts)');
    return;
  }
  const n = s.tokens.length;
  const v = o.message_offsets;
  if (!Array.isArray(v) || v.length === 0)
    throw fail(ctx, 'message_offsets', `expected a non-empty array of token offsets, got ${describeValue(v)}`);
  const offsets = new Int32Array(v.length);
  for (let i = 0; i < v.length; i++) {
    const x: unknown = v[i];
    const prev = i === 0 ? -1 : offsets[i - 1];
    if (typeof x !== 'number' || !Number.isInteger(x) || (i === 0 ? x !== 0 : x <= prev || x >= n))
      throw fail(
        ctx,
        `message_offsets[${i}]`,
        i === 0
          ? `the first message starts at 0, got ${describeValue(x)}`
          : `expected an offset in ${prev + 1}..${n - 1} (increasing, inside the ${n} tokens), got ${describeValue(x)}`,
      );
    offsets[i] = x;
  }
  s.message_offsets = offsets;
  const a = o.message_authors;
  if (a === undefined || a === null) return;
  if (!Array.isArray(a)) throw fail(ctx, 'message_authors', `expected an array of authors, got ${describeValue(a)}`);
  checkLength(a, offsets.length, 'one per message', ctx, 'message_authors');
  for (let i = 0; i < a.length; i++)
    if (!(AUTHORS as readonly unknown[]).includes(a[i]))
      throw fail(ctx, `message_authors[${i}]`, `expected one of ${AUTHORS.join(', ')}, got ${describeValue(a[i])}`);
  // Only what the policy generated is trained, and the merge trains 'llm' messages only: a trainable token in a
  // message of another author would be dropped silently when its timeline is absorbed.
  for (let i = 0; i < a.length; i++) {
    if (a[i] === 'llm') continue;
    const end = i + 1 < offsets.length ? offsets[i + 1] : n;
    for (let t = Math.max(offsets[i], 1); t < end; t++) {
      if (s.loss_mask[t])
        throw fail(
          ctx,
          `message_authors[${i}]`,
          `message ${i} has a trainable token (loss_mask[${t}] = 1) but its author is ${JSON.stringify(a[i])}; trainable tokens belong to 'llm' messages`,
        );
    }
  }
  s.message_authors = a as Author[];
}

/** slime's Sample: per-response arrays, expanded here to full length with the prompt untrained. */
function parseSlime(o: Obj, ctx: Ctx, defaultId: string, vocabSize: number | undefined): Sample {
  const id = optId(o, 'id', ctx) ?? optId(o, 'index', ctx) ?? defaultId;
  ctx.record = id;
  const tokens = tokenArray(o.tokens, ctx, 'tokens', vocabSize);
  const n = tokens.length;
  const rl = o.response_length ?? n;
  if (typeof rl !== 'number' || !Number.isInteger(rl) || rl < 0)
    throw fail(ctx, 'response_length', `expected a non-negative integer, got ${describeValue(rl)}`);
  if (rl > n) throw fail(ctx, 'response_length', `response_length ${rl} is larger than the number of tokens (${n})`);
  const prompt = n - rl;
  const loss_mask = new Uint8Array(n);
  const what = `one per response token, response_length = ${rl}`;
  if (o.loss_mask === undefined || o.loss_mask === null) loss_mask.fill(1, prompt);
  else maskInto(o.loss_mask, loss_mask, prompt, what, ctx, 'loss_mask');
  const group = optId(o, 'group', ctx) ?? optId(o, 'group_index', ctx) ?? id;
  const s = baseSample(o, ctx, id, group, tokens, loss_mask);
  if (o.rollout_log_probs !== undefined && o.rollout_log_probs !== null) {
    const lp = new Float32Array(n);
    floatsInto(o.rollout_log_probs, lp, prompt, true, what, ctx, 'rollout_log_probs');
    s.rollout_logprobs = lp;
  }
  // slime keeps the engine's routes over every token but the last, numpy int32 [T - 1, layers, k]: as JSON, nested lists
  const routed = o.rollout_routed_experts;
  if (routed !== undefined && routed !== null)
    s.routes = parseRoutes(routed, n, { file: ctx.file, line: ctx.line, record: id }, 'rollout_routed_experts');
  return s;
}

interface ChatIds {
  id: string;
  group: string;
  episode: string;
  reward: number | undefined;
}

function chatIds(o: Obj, ctx: Ctx, defaultId: string): ChatIds {
  const id = optId(o, 'id', ctx) ?? defaultId;
  ctx.record = id;
  return { id, group: optId(o, 'group', ctx) ?? id, episode: optId(o, 'episode', ctx) ?? id, reward: optNumber(o, 'reward', ctx) };
}

function parseEpisode(o: Obj, ctx: Ctx, defaultId: string): ChatRecord[] {
  const episode = optId(o, 'episode_id', ctx) ?? defaultId;
  ctx.record = episode;
  const group = optId(o, 'task_id', ctx) ?? optId(o, 'group', ctx) ?? episode;
  let reward: number | undefined;
  if (o.meta !== undefined && o.meta !== null) {
    if (!isObject(o.meta)) throw fail(ctx, 'meta', `expected an object, got ${describeValue(o.meta)}`);
    reward = optNumber(o.meta, 'reward', ctx, 'meta.');
  }
  const requests = o.requests;
  if (!Array.isArray(requests)) throw fail(ctx, 'requests', `expected an array of requests, got ${describeValue(requests)}`);
  const out: ChatRecord[] = new Array<ChatRecord>(requests.length);
  for (let k = 0; k < requests.length; k++) {
    const r: unknown = requests[k];
    const path = `requests[${k}]`;
    ctx.record = `${episode}/${k}`;
    if (!isObject(r)) throw fail(ctx, path, `expected a request object, got ${describeValue(r)}`);
    out[k] = parseChat(r, ctx, path + '.', { id: ctx.record, group, episode, reward });
  }
  return out;
}

function parseChat(o: Obj, ctx: Ctx, path: string, ids: ChatIds): ChatRecord {
  const messages = o.messages;
  if (!Array.isArray(messages)) throw fail(ctx, path + 'messages', `expected an array of messages, got ${describeValue(messages)}`);
  const parsed: ChatMessage[] = new Array<ChatMessage>(messages.length);
  for (let i = 0; i < messages.length; i++) parsed[i] = parseMessage(messages[i], ctx, `${path}messages[${i}]`, undefined);
  let response: ChatMessage;
  if (typeof o.response === 'string') response = { role: 'assistant', content: o.response };
  else response = parseMessage(o.response, ctx, path + 'response', 'assistant');
  if (response.role !== 'assistant')
    throw fail(
      ctx,
      path + 'response.role',
      `the response is what the policy generated: expected role "assistant", got ${JSON.stringify(response.role)}`,
    );
  if (isObject(o.response)) parseEngineOutput(o.response, response, ctx, path + 'response.');
  const tools = o.tools;
  if (tools !== undefined && tools !== null) {
    if (!Array.isArray(tools)) throw fail(ctx, path + 'tools', `expected an array of tool schemas, got ${describeValue(tools)}`);
    for (let i = 0; i < tools.length; i++)
      if (!isObject(tools[i])) throw fail(ctx, `${path}tools[${i}]`, `expected a tool schema object, got ${describeValue(tools[i])}`);
  }
  const rec: ChatRecord = {
    kind: 'chat',
    id: ids.id,
    group: ids.group,
    episode: ids.episode,
    messages: parsed,
    tools: tools as unknown[] | null | undefined,
    response,
    source: { file: ctx.file, line: ctx.line },
  };
  const agent = optString(o, 'agent', ctx, path);
  if (agent !== undefined) rec.agent = agent;
  if (ids.reward !== undefined) rec.reward = ids.reward;
  return rec;
}

/** The inference engine's own record of a response: `token_ids` and `logprobs`, one per generated token. */
function parseEngineOutput(o: Obj, m: ChatMessage, ctx: Ctx, path: string): void {
  if (o.token_ids !== undefined && o.token_ids !== null) m.token_ids = tokenArray(o.token_ids, ctx, path + 'token_ids', undefined);
  if (o.logprobs === undefined || o.logprobs === null) return;
  if (!Array.isArray(o.logprobs)) throw fail(ctx, path + 'logprobs', `expected an array of numbers, got ${describeValue(o.logprobs)}`);
  const lp = new Float32Array(o.logprobs.length);
  const what = m.token_ids ? 'one per token_ids entry' : 'one per generated token';
  if (m.token_ids) checkLength(o.logprobs, m.token_ids.length, what, ctx, path + 'logprobs');
  floatsInto(o.logprobs, lp, 0, true, what, ctx, path + 'logprobs');
  m.logprobs = lp;
}

function parseMessage(v: unknown, ctx: Ctx, path: string, defaultRole: string | undefined): ChatMessage {
  if (!isObject(v)) throw fail(ctx, path, `expected a message object, got ${describeValue(v)}`);
  const role = v.role ?? defaultRole;
  if (typeof role !== 'string') throw fail(ctx, path + '.role', `expected a role string, got ${describeValue(role)}`);
  const { content, parts } = parseContent(v.content, ctx, path + '.content');
  const m: ChatMessage = { role, content };
  if (parts) m.parts = parts;
  const p = path + '.';
  if (v.tool_calls !== undefined && v.tool_calls !== null) m.tool_calls = parseToolCalls(v.tool_calls, ctx, p + 'tool_calls');
  for (const key of ['tool_call_id', 'name', 'reasoning_content'] as const) {
    const s = optString(v, key, ctx, p);
    if (s !== undefined) m[key] = s;
  }
  return m;
}

/**
 * OpenAI content: a string, null, or parts: text, and images (`{"type": "image_url", "image_url": {"url": ...}}`, a
 * data URL or a path relative to the input file) decoded here, so a bad image fails at its line.
 */
function parseContent(v: unknown, ctx: Ctx, field: string): { content: string | null; parts?: ContentPart[] } {
  if (v === undefined || v === null) return { content: null };
  if (typeof v === 'string') return { content: v };
  if (!Array.isArray(v)) throw fail(ctx, field, `expected a string, null or an array of content parts, got ${describeValue(v)}`);
  let text = '';
  const parts: ContentPart[] = [];
  let images = 0;
  for (let i = 0; i < v.length; i++) {
    const part: unknown = v[i];
    const at = `${field}[${i}]`;
    if (isObject(part) && part.type === 'text' && typeof part.text === 'string') {
      text += part.text;
      parts.push({ type: 'text', text: part.text });
    } else if (isObject(part) && part.type === 'image_url') {
      const ref = part.image_url;
      const url = typeof ref === 'string' ? ref : isObject(ref) ? ref.url : undefined;
      if (typeof url !== 'string') throw fail(ctx, at + '.image_url.url', `expected an image URL string, got ${describeValue(url)}`);
      const baseDir = ctx.file === '-' || ctx.file.startsWith('<') ? process.cwd() : nodePath.dirname(nodePath.resolve(ctx.file));
      let image: DecodedImage;
      try {
        image = loadImage(url, baseDir);
      } catch (e) {
        if (!(e instanceof ImageInputError)) throw e;
        throw fail(ctx, at + '.image_url.url', e.message);
      }
      parts.push({ type: 'image', image, field: at });
      images++;
    } else {
      const got = isObject(part) ? `a part of type ${JSON.stringify(part.type)}` : describeValue(part);
      throw fail(ctx, at, `expected a text part {"type": "text", "text": string} or an image part {"type": "image_url", ...}, got ${got}`);
    }
  }
  return images > 0 ? { content: text, parts } : { content: text };
}

function parseToolCalls(v: unknown, ctx: Ctx, field: string): ToolCall[] {
  if (!Array.isArray(v)) throw fail(ctx, field, `expected an array of tool calls, got ${describeValue(v)}`);
  const out: ToolCall[] = new Array<ToolCall>(v.length);
  for (let i = 0; i < v.length; i++) {
    const c: unknown = v[i];
    const p = `${field}[${i}]`;
    if (!isObject(c)) throw fail(ctx, p, `expected a tool call object, got ${describeValue(c)}`);
    const fn = c.function;
    if (!isObject(fn)) throw fail(ctx, p + '.function', `expected {"name", "arguments"}, got ${describeValue(fn)}`);
    if (typeof fn.name !== 'string' || fn.name === '')
      throw fail(ctx, p + '.function.name', `expected a function name, got ${describeValue(fn.name)}`);
    const args = fn.arguments ?? {};
    if (typeof args !== 'string' && !isObject(args))
      throw fail(ctx, p + '.function.arguments', `expected a JSON string or an object, got ${describeValue(args)}`);
    const call: ToolCall = { function: { name: fn.name, arguments: args } };
    const id = optString(c, 'id', ctx, p + '.');
    if (id !== undefined) call.id = id;
    const type = optString(c, 'type', ctx, p + '.');
    if (type !== undefined) call.type = type;
    out[i] = call;
  }
  return out;
}
