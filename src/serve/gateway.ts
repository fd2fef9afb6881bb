/**
 * The recording gateway: OpenAI-compatible `/v1/chat/completions` and `/v1/completions` in front of the engine,
 * and the OpenAI Responses (`/v1/responses`) and Anthropic Messages (`/v1/messages`, and its token count) APIs
 * translated to its chat completions (responses.ts, messages.ts). Each call is proxied with token ids and
 * logprobs requested, recorded under its episode (and agent; all `n` choices, the first as the call's output and
 * the others as its siblings), made durable, and only then answered (for a stream: its last event waits for the
 * log), so every answer an agent saw is in the log. The episode comes from, first to last: the URL
 * (`/episodes/{id}/v1/...`, `/groups/{group}/episodes/{id}/v1/...`), the `x-treepack-episode` header, or a scoped
 * API key (`POST /v1/episodes`), so an agent framework needs nothing but a base URL (or an API key).
 */
import { performance } from 'node:perf_hooks';
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { createParser, type EventSourceMessage } from 'eventsource-parser';
import { describeValue } from '../errors.js';
import type { ChatMessage } from '../records/types.js';
import { checkChatMessages } from './chat-check.js';
import {
  clientView,
  EngineError,
  parseResponse,
  responseRoutes,
  StreamAccumulator,
  upstreamRequest,
  type CallKind,
  type ClientWants,
  type EngineOutput,
} from './engine.js';
import { messagesPrompt, messagesRequest } from './messages.js';
import { responsesRequest } from './responses.js';
import { priorToolCalls, wholeChunk, type ApiWriter, type CallMeta } from './translate.js';
import {
  checkId,
  jsonEqual,
  Pool,
  PoolError,
  recordDigest,
  type CallRequest,
  type Episode,
  type RecordedCall,
  type Scope,
} from './pool.js';
import { postUpstream, type Upstream } from './upstream.js';
import { RoutesDropped, type RawRoutes } from './routed-experts.js';
import { emptyRecordStats, episodeLines } from './records.js';
import type { Recorder, SharedGroup } from './recorder.js';

/** What the gateway's routes use of the recording core. */
export type GatewayCore = Pick<
  Recorder,
  | 'pool'
  | 'feed'
  | 'opts'
  | 'metrics'
  | 'encoder'
  | 'shared'
  | 'images'
  | 'commit'
  | 'admit'
  | 'abandonGroup'
  | 'openEpisode'
  | 'noteRoutesDropped'
  | 'routes'
>;
/** gateway calls in flight by episode and Idempotency-Key: a retry waits for the first attempt */
type InFlight = Map<string, Promise<unknown>>;

type Obj = Record<string, unknown>;
const isObj = (v: unknown): v is Obj => typeof v === 'object' && v !== null && !Array.isArray(v);

function header(req: FastifyRequest, name: string): string | undefined {
  const v = req.headers[name];
  return typeof v === 'string' && v !== '' ? v : undefined;
}

/**
 * The credential a request presents, if any: its bearer token, or its `x-api-key` header (how Anthropic's
 * clients send their key).
 */
export function bearer(req: FastifyRequest): string | undefined {
  const m = /^Bearer\s+(.+)$/i.exec(req.headers.authorization ?? '');
  return m?.[1] ?? header(req, 'x-api-key');
}

/** The scope of the scoped API key a request presents, if it presents one. */
export function keyScope(svc: GatewayCore, req: FastifyRequest): Scope | undefined {
  const key = bearer(req);
  return key === undefined ? undefined : svc.pool.keyScope(key);
}

function outOfScope(key: Scope, what: string): PoolError {
  return new PoolError(403, `this API key opens episode ${JSON.stringify(key.episode)} only: ${what}`);
}

/** Refuses a request made with a scoped key of another episode than `episode`. */
export function confine(svc: GatewayCore, req: FastifyRequest, episode: string): void {
  const key = keyScope(svc, req);
  if (key && key.episode !== episode) throw outOfScope(key, `not episode ${JSON.stringify(episode)}`);
}

/**
 * The episode, agent and group of a call. A scoped key fixes all three: a URL or header naming another episode or
 * group, or another agent than the key's, is refused (an agent header is free where the key names no agent).
 */
function scopeOf(svc: GatewayCore, req: FastifyRequest): Scope {
  const scope = requestScope(svc, req);
  if (scope === undefined) {
    throw new PoolError(
      400,
      'no episode for this call: use a base URL /episodes/{id}/v1, the x-treepack-episode header, or an API key from POST /v1/episodes',
    );
  }
  return scope;
}

/** `scopeOf`, or undefined where the request names no episode. */
function requestScope(svc: GatewayCore, req: FastifyRequest): Scope | undefined {
  const params = req.params as { episode?: string; group?: string };
  const keyed = keyScope(svc, req);
  const episode = params.episode ?? header(req, 'x-treepack-episode') ?? keyed?.episode;
  if (episode === undefined) return undefined;
  const agent = header(req, 'x-treepack-agent');
  const group = params.group ?? header(req, 'x-treepack-group');
  if (keyed) {
    if (episode !== keyed.episode) throw outOfScope(keyed, `not episode ${JSON.stringify(episode)}`);
    if (group !== undefined && group !== keyed.group)
      throw outOfScope(
        keyed,
        `its group is ${keyed.group === undefined ? 'the episode' : JSON.stringify(keyed.group)}, not ${JSON.stringify(group)}`,
      );
    if (agent !== undefined && keyed.agent !== undefined && agent !== keyed.agent)
      throw outOfScope(keyed, `its agent is ${JSON.stringify(keyed.agent)}, not ${JSON.stringify(agent)}`);
  }
  const scope: Scope = { episode };
  const a = agent ?? keyed?.agent;
  if (a !== undefined) scope.agent = a;
  const g = group ?? keyed?.group;
  if (g !== undefined) scope.group = g;
  return scope;
}

function checkBody(kind: CallKind, body: unknown): Obj {
  if (!isObj(body)) throw new PoolError(400, `request body: expected a JSON object, got ${describeValue(body)}`);
  if (kind === 'chat') {
    if (!Array.isArray(body.messages) || body.messages.length === 0)
      throw new PoolError(400, `field "messages": expected a non-empty list of messages, got ${describeValue(body.messages)}`);
    body.messages.forEach((m, i) => {
      if (!isObj(m)) throw new PoolError(400, `field "messages[${i}]": expected a message object, got ${describeValue(m)}`);
      if (typeof m.role !== 'string')
        throw new PoolError(
          400,
          `field "messages[${i}].role": expected a string (system, user, assistant, tool), got ${describeValue(m.role)}`,
        );
    });
    if (body.tools !== undefined && body.tools !== null && !Array.isArray(body.tools))
      throw new PoolError(400, `field "tools": expected a list of tool schemas, got ${describeValue(body.tools)}`);
  } else if (typeof body.prompt !== 'string') {
    throw new PoolError(400, `field "prompt": expected a string (one prompt per call is recorded), got ${describeValue(body.prompt)}`);
  }
  // The engine would coerce "yes" or 1 and stream, where the gateway reads JSON: refused, naming the field.
  if (body.stream !== undefined && body.stream !== null && typeof body.stream !== 'boolean')
    throw new PoolError(400, `field "stream": expected true or false, got ${describeValue(body.stream)}`);
  if (body.n !== undefined && body.n !== null && (!Number.isSafeInteger(body.n) || (body.n as number) < 1 || (body.n as number) > MAX_N))
    throw new PoolError(400, `field "n": expected an integer in 1..${MAX_N}, got ${describeValue(body.n)}`);
  return body;
}

const JSON_TYPE = 'application/json; charset=utf-8';

/** The most choices one call may ask for: each is recorded, and they share the call's bound on the pool. */
const MAX_N = 128;

function policyVersion(svc: GatewayCore, req: FastifyRequest): number {
  const v = header(req, 'x-treepack-policy-version');
  if (v === undefined) return svc.feed.version;
  const n = Number(v);
  if (!Number.isSafeInteger(n) || n < 0)
    throw new PoolError(400, `header "x-treepack-policy-version": expected an integer >= 0, got ${JSON.stringify(v)}`);
  return n;
}

async function callEngine(svc: GatewayCore, kind: CallKind, body: Obj): Promise<Upstream> {
  const url = `${svc.opts.engineUrl}/${kind === 'chat' ? 'chat/completions' : 'completions'}`;
  const headers: Record<string, string> = { 'content-type': 'application/json' };
  if (svc.opts.engineApiKey) headers.authorization = `Bearer ${svc.opts.engineApiKey}`;
  try {
    return await postUpstream(url, JSON.stringify(body), headers, svc.opts.engineTimeoutMs);
  } catch (err) {
    throw engineFailure(svc, err as Error);
  }
}

function engineFailure(svc: GatewayCore, e: Error): PoolError {
  if (e.name === 'TimeoutError')
    return new PoolError(504, `the engine at ${svc.opts.engineUrl} did not answer within ${svc.opts.engineTimeoutMs} ms`);
  if (e.name === 'TruncatedError') return new PoolError(502, `the engine at ${svc.opts.engineUrl} ${e.message}`);
  return new PoolError(502, `the engine at ${svc.opts.engineUrl} is unreachable: ${e.message}`);
}

/**
 * How one API's calls are checked, sent to the engine, recorded and answered: chat and legacy completions as the
 * engine speaks them, the Responses and Messages APIs translated to chat completions (translate.ts).
 */
interface Dialect {
  /** the metrics' endpoint label */
  endpoint: string;
  /** what the engine is asked, and what is recorded */
  kind: CallKind;
  /** the Anthropic error shape (else OpenAI's) */
  anthropic?: boolean;
  prepare(body: unknown, episode: Episode | undefined): Prepared;
}

interface Prepared {
  /** the engine's request, asking for token ids and logprobs */
  upstream: Obj;
  request: CallRequest;
  /** choices asked for */
  n: number;
  stream: boolean;
  /** makes the outputs what the client is shown (tool call ids) before they are recorded */
  complete(outputs: EngineOutput[], call: CallMeta): void;
  /** the answer to a complete engine response */
  answer(json: Obj, outputs: EngineOutput[], call: CallMeta): Obj;
  writer(call: CallMeta): StreamWriter;
  /** a recorded call as the answer to a retry of it: whole, or as its stream */
  replay(call: RecordedCall): { json: Obj } | { sse: string };
}

type StreamWriter = Pick<ApiWriter, 'chunk' | 'end' | 'fail'>;

function openaiDialect(kind: CallKind): Dialect {
  return {
    endpoint: kind === 'chat' ? 'chat' : 'completions',
    kind,
    prepare(raw) {
      const body = checkBody(kind, raw);
      const { body: upstream, wants } = upstreamRequest(kind, body);
      const request: CallRequest = {};
      if (kind === 'chat') {
        request.messages = body.messages as unknown[];
        if (Array.isArray(body.tools) && body.tools.length) request.tools = body.tools;
      } else request.prompt = body.prompt as string;
      return {
        upstream,
        request,
        n: (body.n as number | undefined) ?? 1,
        stream: body.stream === true,
        complete: () => {},
        answer: (json) => clientView(json, wants),
        writer: () => ({
          chunk: (c) => `data: ${JSON.stringify(clientView(c, wants))}\n\n`,
          end: () => 'data: [DONE]\n\n',
          // [DONE] is withheld so the client sees a failure
          fail: (message) => `data: ${JSON.stringify({ error: { message, type: 'engine_error' } })}\n\n`,
        }),
        replay: (call) => replayAnswer(kind, call, body, wants),
      };
    },
  };
}

function translatedDialect(endpoint: 'responses' | 'messages'): Dialect {
  return {
    endpoint,
    kind: 'chat',
    anthropic: endpoint === 'messages',
    prepare(raw, episode) {
      const t = endpoint === 'responses' ? responsesRequest(raw) : messagesRequest(raw, priorToolCalls(episode?.calls));
      if (t.chat.n !== undefined && t.chat.n !== null && t.chat.n !== 1)
        throw new PoolError(
          400,
          `field "n": the ${endpoint === 'responses' ? 'Responses' : 'Messages'} API answers one output per call; ask for several through /v1/chat/completions`,
        );
      const { body: upstream } = upstreamRequest('chat', t.chat);
      // the usage of a streamed answer comes in a last chunk, on request
      if (t.stream) upstream.stream_options = { include_usage: true };
      const whole = (o: EngineOutput, call: CallMeta, extra?: Parameters<typeof wholeChunk>[1]) => {
        const w = t.writer(call);
        w.chunk(wholeChunk(o, extra));
        return w;
      };
      return {
        upstream,
        request: t.request,
        n: 1,
        stream: t.stream,
        complete: (outputs, call) => t.complete(outputs[0], call),
        answer: (json, outputs, call) => {
          const c = (json.choices as Obj[]).find((x) => (x.index ?? 0) === 0)!;
          return whole(outputs[0], call, { logprobs: c.logprobs, usage: json.usage, stopReason: c.stop_reason }).answer();
        },
        writer: (call) => t.writer(call),
        replay: (call) => {
          const w = whole(call.output, { id: call.id, time: call.time });
          return t.stream ? { sse: w.end() } : { json: w.answer() };
        },
      };
    },
  };
}

/** A call's Idempotency-Key, the digest of its body and the answer it got: what a retry of it is checked against. */
interface Retryable {
  requestId: string;
  requestDigest: string;
  answer: { text: string; sse?: true };
}

function recordedCall(
  kind: CallKind,
  scope: Scope,
  request: CallRequest,
  outputs: EngineOutput[],
  version: number,
  retry: Retryable | undefined,
  meta: CallMeta,
): RecordedCall {
  const call: RecordedCall = { id: meta.id, kind, time: meta.time, policyVersion: version, request, output: outputs[0] };
  // n > 1: the other choices share the call's prompt, each one more branch of the episode's tree
  if (outputs.length > 1) call.siblings = outputs.slice(1);
  if (scope.agent !== undefined) call.agent = scope.agent;
  if (retry !== undefined) Object.assign(call, retry);
  return call;
}

/** The client's request id: a retry carrying the same one is answered from the call it recorded. */
function requestId(req: FastifyRequest): string | undefined {
  const v = header(req, 'idempotency-key');
  if (v !== undefined && v.length > 256)
    throw new PoolError(400, `header "Idempotency-Key": expected at most 256 characters, got ${v.length}`);
  return v;
}

/**
 * A recorded call as the engine's answer to a retry of it: its choices (with token ids and logprobs where the
 * client asks for them), as a body or as a stream of one chunk.
 */
function replayAnswer(kind: CallKind, call: RecordedCall, body: Obj, wants: ClientWants): { json: Obj } | { sse: string } {
  const choices = [call.output, ...(call.siblings ?? [])].map((o, index) => {
    const choice: Obj = { index, finish_reason: o.finishReason, logprobs: null };
    if (kind === 'chat') choice.message = o.message;
    else choice.text = o.text;
    if (wants.logprobs && o.logprobs)
      choice.logprobs = kind === 'chat' ? { content: o.logprobs.map((logprob) => ({ logprob })) } : { token_logprobs: o.logprobs };
    if (wants.tokenIds && o.tokenIds) choice.token_ids = o.tokenIds;
    return choice;
  });
  const json: Obj = {
    id: call.id,
    object: kind === 'chat' ? 'chat.completion' : 'text_completion',
    created: Math.floor(call.time / 1000),
    model: body.model ?? null,
    choices,
  };
  if (wants.tokenIds && call.output.promptTokenIds) json.prompt_token_ids = call.output.promptTokenIds;
  if (body.stream !== true) return { json };
  if (kind === 'chat') {
    json.choices = choices.map(({ message, ...rest }) => ({ ...rest, delta: message }));
    json.object = 'chat.completion.chunk';
  }
  return { sse: `data: ${JSON.stringify(json)}\n\ndata: [DONE]\n\n` };
}

/** Counts an engine failure (down, slow, garbage) before it goes back to the client. */
function countFailure(svc: GatewayCore, endpoint: string, err: unknown): never {
  if (err instanceof EngineError) svc.metrics.calls.inc({ endpoint, outcome: 'engine_garbage' });
  else if (err instanceof PoolError && err.status === 504) svc.metrics.calls.inc({ endpoint, outcome: 'engine_timeout' });
  else if (err instanceof PoolError && err.status === 502) svc.metrics.calls.inc({ endpoint, outcome: 'engine_unreachable' });
  throw err;
}

async function proxy(svc: GatewayCore, inflight: InFlight, d: Dialect, req: FastifyRequest, reply: FastifyReply): Promise<unknown> {
  const scope = scopeOf(svc, req);
  const rid = requestId(req);
  if (rid === undefined) return proxyOnce(svc, d, req, reply, scope, undefined).catch((err) => countFailure(svc, d.endpoint, err));
  // A retry while the first attempt is in flight waits for it, then is answered from its record (or tries again).
  const key = `${scope.episode}\n${rid}`;
  for (let earlier = inflight.get(key); earlier; earlier = inflight.get(key)) await earlier.catch(() => {});
  const done = proxyOnce(svc, d, req, reply, scope, rid);
  inflight.set(key, done);
  try {
    return await done;
  } catch (err) {
    return countFailure(svc, d.endpoint, err);
  } finally {
    if (inflight.get(key) === done) inflight.delete(key); // a retry that waited may hold it by now
  }
}

async function proxyOnce(
  svc: GatewayCore,
  d: Dialect,
  req: FastifyRequest,
  reply: FastifyReply,
  scope: Scope,
  rid: string | undefined,
): Promise<unknown> {
  const endpoint = d.endpoint;
  const t0 = performance.now();
  const version = policyVersion(svc, req);
  const episode = svc.pool.episodes.get(scope.episode);
  const p = d.prepare(req.body, episode);
  // Refused before the engine sees it, or recorded as the packer will read it (chat-check.ts).
  if (d.kind === 'chat') {
    p.request.messages = p.upstream.messages = checkChatMessages(
      p.request.messages ?? [],
      p.request.tools,
      svc.encoder,
      svc.opts.maxImageBytes,
    );
  }
  // SGLang returns routes only when asked, vLLM ignores the field; a client's own ask passes as it is
  if (svc.opts.recordRoutes) p.upstream.return_routed_experts = true;
  const digest = rid === undefined ? undefined : recordDigest(req.body as Obj);
  const recorded = rid === undefined ? undefined : episode?.requests?.get(rid);
  if (recorded) {
    // The IETF Idempotency-Key draft (and Stripe): a key reused for another request is the client's error.
    if (recorded.requestDigest !== undefined && recorded.requestDigest !== digest) {
      const why = `header "Idempotency-Key" ${JSON.stringify(rid)} was used by call ${recorded.id} of episode ${JSON.stringify(scope.episode)}`;
      throw new PoolError(422, `${why} with another request body: a new request needs a new key`, 'idempotency_key_reused');
    }
    svc.metrics.calls.inc({ endpoint, outcome: 'replayed' });
    reply.header('x-treepack-replayed', 'true');
    if (recorded.answer)
      return reply.header('content-type', recorded.answer.sse ? 'text/event-stream' : JSON_TYPE).send(recorded.answer.text);
    // recorded by a service that kept no answers: rebuilt from the record
    const r = p.replay(recorded);
    return 'json' in r ? reply.send(r.json) : reply.header('content-type', 'text/event-stream').send(r.sse);
  }
  svc.admit();
  svc.pool.checkCall(scope.episode, scope.group);
  await svc.openEpisode(scope.episode, scope.group);
  const meta: CallMeta = { id: Pool.newId(), time: Date.now() };
  const tEngine = performance.now();
  const res = await callEngine(svc, d.kind, p.upstream);
  if (res.status < 200 || res.status >= 300) {
    // The engine's own refusal (bad parameters, overload) goes back as it is, and nothing is recorded.
    svc.metrics.calls.inc({ endpoint, outcome: `engine_${res.status}` });
    const text = await res.text().catch((err: Error) => Promise.reject(engineFailure(svc, err)));
    if (d.anthropic) throw new PoolError(res.status, `the engine refused the call: ${engineMessage(text)}`);
    return reply
      .code(res.status)
      .header('content-type', res.contentType ?? 'application/json')
      .send(text);
  }
  const commit = async (outputs: EngineOutput[], answer: () => string, routes: (RawRoutes | undefined)[]) => {
    await attachRoutes(svc, outputs, routes, meta.id);
    p.complete(outputs, meta);
    // only a call a client may retry keeps its answer
    const kept = () => (p.stream ? { text: answer(), sse: true as const } : { text: answer() });
    const retry = rid === undefined ? undefined : { requestId: rid, requestDigest: digest!, answer: kept() };
    // the images' bytes durable (images.ts) before the line that names them
    const request = p.request.messages ? { ...p.request, messages: await svc.images.record(p.request.messages) } : p.request;
    await svc.commit({
      type: 'call',
      episode: scope.episode,
      group: scope.group,
      call: recordedCall(d.kind, scope, request, outputs, version, retry, meta),
    });
    svc.metrics.calls.inc({ endpoint, outcome: 'recorded' });
  };
  if (!p.stream) {
    let json: unknown;
    const text = await res.text().catch((err: Error) => Promise.reject(engineFailure(svc, err)));
    const tBack = performance.now();
    svc.metrics.engine.observe({ endpoint }, (tBack - tEngine) / 1000);
    try {
      json = JSON.parse(text);
    } catch {
      throw new EngineError(`expected JSON, got ${describeValue(text)}`);
    }
    const outputs = parseResponse(d.kind, json, p.n);
    const routes = responseRoutes(json as Obj, p.n); // read before the answer leaves them out
    // built before the call is recorded: an output the API cannot carry is refused, not recorded
    const answer = JSON.stringify(p.answer(json as Obj, outputs, meta));
    await commit(outputs, () => answer, routes);
    svc.metrics.latency.observe({ endpoint }, (performance.now() - tBack + (tEngine - t0)) / 1000);
    return reply.header('content-type', JSON_TYPE).send(answer);
  }
  return stream(svc, new StreamAccumulator(d.kind, p.n), p.writer(meta), res, reply, commit, { t0, tEngine, endpoint });
}

/**
 * Puts on each output the routes the engine returned for it, checked against its prompt and generated tokens (on the
 * routes thread); routes that cannot be recorded are counted and left out, and the call is recorded without them.
 */
async function attachRoutes(svc: GatewayCore, outputs: EngineOutput[], routes: (RawRoutes | undefined)[], callId: string): Promise<void> {
  const opts = { shape: svc.opts.routeShape, maxBytes: svc.opts.maxRouteBytes };
  await Promise.all(
    outputs.map(async (out, k) => {
      const raw = routes[k];
      if (!raw) return;
      const tokens = out.promptTokenIds && out.tokenIds ? out.promptTokenIds.length + out.tokenIds.length : undefined;
      try {
        out.routes = await svc.routes.record(raw, tokens, opts);
      } catch (err) {
        if (!(err instanceof RoutesDropped)) throw err;
        svc.noteRoutesDropped(callId, err);
      }
    }),
  );
}

/** The message of an engine's error body (OpenAI's shape), else its text. */
function engineMessage(text: string): string {
  try {
    const j = JSON.parse(text) as unknown;
    if (isObj(j) && isObj(j.error) && typeof j.error.message === 'string') return j.error.message;
  } catch {
    // not JSON
  }
  return text.slice(0, 500);
}

async function stream(
  svc: GatewayCore,
  acc: StreamAccumulator,
  w: StreamWriter,
  res: Upstream,
  reply: FastifyReply,
  commit: (o: EngineOutput[], answer: () => string, routes: (RawRoutes | undefined)[]) => Promise<void>,
  t: { t0: number; tEngine: number; endpoint: string },
): Promise<void> {
  let done = false;
  let failure: Error | undefined;
  const out: string[] = [];
  /** what the client was sent, for a retry's replay */
  const sent: string[] = [];
  const parser = createParser({
    onEvent(ev: EventSourceMessage) {
      if (failure) return;
      if (ev.data === '[DONE]') {
        done = true;
        return;
      }
      try {
        const chunk = JSON.parse(ev.data) as unknown;
        acc.add(chunk);
        out.push(w.chunk(chunk as Obj));
      } catch (err) {
        failure =
          err instanceof EngineError || err instanceof PoolError
            ? err
            : new EngineError(`stream event is not JSON: ${describeValue(ev.data)}`);
      }
    },
  });
  reply.hijack();
  const raw = reply.raw;
  raw.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache', connection: 'keep-alive' });
  const decoder = new TextDecoder();
  try {
    for await (const piece of res.body as AsyncIterable<Uint8Array>) {
      parser.feed(decoder.decode(piece, { stream: true }));
      if (out.length) {
        const piece = out.splice(0).join('');
        sent.push(piece);
        raw.write(piece);
      }
      if (failure) break;
    }
  } catch (err) {
    failure ??= res.timedOut()
      ? new EngineError(`the engine's stream did not end within ${svc.opts.engineTimeoutMs} ms (--engine-timeout)`)
      : new EngineError(`the engine's stream broke: ${(err as Error).message}`);
  }
  const tBack = performance.now();
  if (!failure && !done) failure = new EngineError('the engine closed the stream without data: [DONE]');
  let tail = '';
  if (!failure) {
    try {
      tail = w.end(); // before the call is recorded: an output the API cannot carry is refused, not recorded
      await commit(acc.result(), () => sent.join('') + tail, acc.routes);
    } catch (err) {
      failure = err as Error;
    }
  }
  if (failure) {
    // Headers are gone: the error travels as an SSE event, and the stream's end is withheld.
    svc.metrics.calls.inc({ endpoint: t.endpoint, outcome: res.timedOut() ? 'engine_timeout' : 'engine_garbage' });
    raw.end(w.fail(failure.message));
    return;
  }
  svc.metrics.latency.observe({ endpoint: t.endpoint }, (performance.now() - tBack + (t.tEngine - t.t0)) / 1000);
  raw.end(tail);
}

function finishBody(body: unknown, maxGroupSize: number): { reward: number; metadata?: Obj; group_size?: number } {
  if (!isObj(body))
    throw new PoolError(400, `request body: expected a JSON object {"reward": number, "metadata"?: object}, got ${describeValue(body)}`);
  if (typeof body.reward !== 'number' || !Number.isFinite(body.reward))
    throw new PoolError(400, `field "reward": expected a finite number, got ${describeValue(body.reward)}`);
  const out: { reward: number; metadata?: Obj; group_size?: number } = { reward: body.reward };
  if (body.metadata !== undefined && body.metadata !== null) {
    if (!isObj(body.metadata)) throw new PoolError(400, `field "metadata": expected an object, got ${describeValue(body.metadata)}`);
    out.metadata = body.metadata;
  }
  if (body.group_size !== undefined && body.group_size !== null) {
    if (!Number.isSafeInteger(body.group_size) || (body.group_size as number) < 1 || (body.group_size as number) > maxGroupSize) {
      throw new PoolError(
        400,
        `field "group_size": expected an integer in 1..${maxGroupSize} (the service's --max-group-size), got ${describeValue(body.group_size)}`,
      );
    }
    out.group_size = body.group_size as number;
  }
  return out;
}

const NO_CALL = 'finished without a call';

/**
 * `/v1/messages/count_tokens`: the prompt tokens the engine gets for the equivalent `/v1/messages` call, the
 * translated chat messages and tools rendered by the service's chat template with its generation prompt and
 * tokenized by its tokenizer: what a recorded call's prompt is wherever the template renders the engine's own.
 * Not a call of the episode: nothing is recorded or opened, the engine is not asked. The episode (confined to a
 * scoped key's as a call is) only supplies the arguments text of the tool calls it recorded, as for a call.
 */
function countTokens(svc: GatewayCore, req: FastifyRequest): { input_tokens: number } {
  const scope = requestScope(svc, req);
  const episode = scope && svc.pool.episodes.get(scope.episode);
  const { request, templateVars } = messagesPrompt(req.body, priorToolCalls(episode?.calls));
  return { input_tokens: svc.encoder.encodePrompt(request.messages as ChatMessage[], request.tools, templateVars).length };
}

/** Routes a scoped API key may use (its own episode's, checked by the route): every other route refuses it. */
export const SCOPED = { config: { scoped: true } };
/** The Messages API's routes: scoped, their errors in Anthropic's shape (http.ts). */
const ANTHROPIC = { config: { scoped: true, errorShape: 'anthropic' } };

/** The group an episode counts toward: its own, or where no call made it yet, the key's or the request's. */
function groupOf(svc: GatewayCore, episode: string, given: string | undefined): string {
  return svc.pool.episodes.get(episode)?.group ?? given ?? svc.pool.keyed.get(episode)?.group ?? episode;
}

function groupAnswer(svc: GatewayCore, group: string, shared: SharedGroup | undefined) {
  const g = svc.pool.groups.get(group)!;
  // On the shared pool the group's other episodes may come through other gateways: Redis counts them.
  const episodes = shared === undefined ? (svc.shared ? null : g.finished + g.abandoned) : 'episodes' in shared ? shared.episodes : null;
  return {
    group: g.id,
    group_finished: g.complete || (episodes !== null && episodes >= g.size),
    group_episodes: episodes,
    group_size: g.size,
  };
}

const CHAT = openaiDialect('chat');
const COMPLETIONS = openaiDialect('completion');
const RESPONSES = translatedDialect('responses');
const MESSAGES = translatedDialect('messages');

export function registerGateway(app: FastifyInstance, svc: GatewayCore): void {
  const inflight: InFlight = new Map();
  for (const prefix of ['', '/episodes/:episode', '/groups/:group/episodes/:episode']) {
    app.post(`${prefix}/v1/chat/completions`, SCOPED, (req, reply) => proxy(svc, inflight, CHAT, req, reply));
    app.post(`${prefix}/v1/completions`, SCOPED, (req, reply) => proxy(svc, inflight, COMPLETIONS, req, reply));
    app.post(`${prefix}/v1/responses`, SCOPED, (req, reply) => proxy(svc, inflight, RESPONSES, req, reply));
    app.post(`${prefix}/v1/messages`, ANTHROPIC, (req, reply) => proxy(svc, inflight, MESSAGES, req, reply));
    app.post(`${prefix}/v1/messages/count_tokens`, ANTHROPIC, async (req) => countTokens(svc, req));
    // The episode's base URL serves the model list too (openai's client.models.list()), with the engine's key.
    app.get(`${prefix}/v1/models`, SCOPED, async (req, reply) => {
      if (req.params && (req.params as { episode?: string }).episode !== undefined) scopeOf(svc, req);
      const headers: Record<string, string> = svc.opts.engineApiKey ? { authorization: `Bearer ${svc.opts.engineApiKey}` } : {};
      const res = await fetch(`${svc.opts.engineUrl}/models`, { headers, signal: AbortSignal.timeout(svc.opts.engineTimeoutMs) }).catch(
        (err: Error) => {
          throw engineFailure(svc, err);
        },
      );
      return reply
        .code(res.status)
        .header('content-type', 'application/json')
        .send(await res.text());
    });
  }

  /** A scoped API key for one episode (and agent, group): the agent's only configuration. */
  app.post('/v1/episodes', async (req) => {
    const b = (req.body ?? {}) as unknown;
    if (!isObj(b)) throw new PoolError(400, `request body: expected a JSON object, got ${describeValue(b)}`);
    for (const f of ['episode_id', 'agent', 'group'] as const) {
      if (b[f] === undefined) continue;
      if (typeof b[f] !== 'string') throw new PoolError(400, `field "${f}": expected a string id, got ${describeValue(b[f])}`);
      checkId(`field "${f}"`, b[f]);
    }
    const scope: Scope = { episode: (b.episode_id as string | undefined) ?? Pool.newId() };
    if (b.agent !== undefined) scope.agent = b.agent as string;
    if (b.group !== undefined) scope.group = b.group as string;
    const key = Pool.newKey();
    // The log keeps the key's hash only: whoever reads the log cannot call as the agent.
    await svc.commit({ type: 'key', hash: Pool.keyHash(key), scope, time: Date.now() });
    return { episode_id: scope.episode, agent: scope.agent ?? null, group: scope.group ?? null, api_key: key };
  });

  app.get('/v1/episodes/:id', async (req) => {
    const { id } = req.params as { id: string };
    const ep = svc.pool.episodes.get(id);
    if (!ep) throw new PoolError(404, `unknown episode ${JSON.stringify(id)}`);
    // a call's answer kept for retries is what the client got, not part of the recorded call; images as data URLs
    const calls = (await svc.images.hydrate(ep)).calls.map(({ answer: _answer, ...call }) => call);
    return {
      episode_id: ep.id,
      group: ep.group,
      agents: [...ep.agents],
      finished: ep.finished,
      abandoned: ep.abandoned ?? null,
      reward: ep.reward ?? null,
      metadata: ep.metadata ?? null,
      calls,
    };
  });

  /** The episode as the JSONL records the trainer feed packs (what `treepack pack` would read for it). */
  app.get('/v1/episodes/:id/records', async (req, reply) => {
    const { id } = req.params as { id: string };
    const ep = svc.pool.episodes.get(id);
    if (!ep) throw new PoolError(404, `unknown episode ${JSON.stringify(id)}`);
    if (svc.pool.groups.get(ep.group)!.consumed)
      throw new PoolError(410, `episode ${JSON.stringify(id)} was consumed; its records are in the log only`);
    if (ep.shipped)
      throw new PoolError(410, `episode ${JSON.stringify(id)} was shipped to the shared pool; its records are in the log only`);
    const lines = episodeLines(await svc.images.hydrate(ep), svc.encoder, emptyRecordStats());
    return reply.header('content-type', 'application/x-ndjson').send(lines.map((l) => JSON.stringify(l) + '\n').join(''));
  });

  /**
   * Ends an episode with its reward. A retry with the same reward and metadata is answered as the first was; an
   * episode under which no call was recorded (its agent crashed first) is abandoned: nothing of it can train.
   */
  app.post('/v1/episodes/:id/finish', SCOPED, async (req) => {
    const { id } = req.params as { id: string };
    confine(svc, req, id);
    const b = finishBody(req.body, svc.opts.maxGroupSize);
    // A group may hold other tenants' episodes: its size is the orchestrator's to set (the service token, or any
    // caller of a loopback service without one), never one agent's.
    const key = keyScope(svc, req);
    if (key && b.group_size !== undefined)
      throw outOfScope(key, 'field "group_size" is set by the service token, not by an episode\'s key');
    const ep = svc.pool.episodes.get(id);
    if (
      ep?.finished &&
      ep.reward === b.reward &&
      jsonEqual(ep.metadata ?? null, b.metadata ?? null) &&
      (b.group_size === undefined || b.group_size === svc.pool.groups.get(ep.group)!.size)
    ) {
      return { episode_id: id, ...groupAnswer(svc, ep.group, undefined), abandoned: false };
    }
    if (!ep || ep.abandoned === NO_CALL) return abandon(svc, id, groupOf(svc, id, undefined), NO_CALL);
    const shared = await svc.commit({ type: 'finish', episode: id, ...b, time: Date.now() });
    svc.metrics.episodes.inc();
    return { episode_id: id, ...groupAnswer(svc, ep.group, shared), abandoned: false };
  });

  /** Gives up an episode: it is not trained, and counts toward its group as if finished. */
  app.post('/v1/episodes/:id/abandon', SCOPED, async (req) => {
    const { id } = req.params as { id: string };
    confine(svc, req, id);
    const b = (req.body ?? {}) as unknown;
    if (!isObj(b) || (b.group !== undefined && typeof b.group !== 'string'))
      throw new PoolError(400, `request body: expected {"group"?: string}, got ${describeValue(b)}`);
    if (b.group !== undefined) checkId('field "group"', b.group);
    const key = keyScope(svc, req);
    if (key && b.group !== undefined && b.group !== key.group) throw outOfScope(key, `not group ${JSON.stringify(b.group)}`);
    return abandon(svc, id, groupOf(svc, id, b.group), 'abandoned');
  });

  /** Gives up a group: its unfinished episodes are abandoned and it is trained with the finished ones it has. */
  app.post('/v1/groups/:id/abandon', async (req) => {
    const { id } = req.params as { id: string };
    const g = await svc.abandonGroup(id, 'abandoned', 0);
    return { group: id, abandoned: true, episodes_finished: g.finished, episodes_abandoned: g.abandoned };
  });
}

async function abandon(svc: GatewayCore, episode: string, group: string, reason: string) {
  const ep = svc.pool.episodes.get(episode);
  let shared: SharedGroup | undefined;
  if (!ep?.abandoned) shared = await svc.commit({ type: 'abandon', episode, group, reason, time: Date.now() });
  return { episode_id: episode, ...groupAnswer(svc, svc.pool.episodes.get(episode)!.group, shared), abandoned: true };
}
