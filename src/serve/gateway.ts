/**
 * The recording gateway: OpenAI-compatible `/v1/chat/completions` and `/v1/completions` in front of the engine.
 * Each call is proxied with token ids and logprobs requested, recorded under its episode (and agent), made
 * durable, and only then answered (for a stream: the final `data: [DONE]` waits for the log), so every answer
 * an agent saw is in the log. The episode comes from, first to last: the URL (`/episodes/{id}/v1/...`,
 * `/groups/{group}/episodes/{id}/v1/...`), the `x-treepack-episode` header, or a scoped API key
 * (`POST /v1/episodes`), so an agent framework needs nothing but a base URL (or an API key).
 */
import { performance } from 'node:perf_hooks';
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { createParser, type EventSourceMessage } from 'eventsource-parser';
import { describeValue } from '../errors.js';
import { clientView, EngineError, parseResponse, StreamAccumulator, upstreamRequest, type CallKind, type EngineOutput } from './engine.js';
import { jsonEqual, Pool, PoolError, type RecordedCall, type Scope } from './pool.js';
import { postUpstream, type Upstream } from './upstream.js';
import { emptyRecordStats, episodeLines } from './records.js';
import type { Recorder, SharedGroup } from './recorder.js';

/** What the gateway's routes use of the recording core. */
export type GatewayCore = Pick<Recorder, 'pool' | 'feed' | 'opts' | 'metrics' | 'encoder' | 'shared' | 'commit' | 'admit' | 'abandonGroup' | 'openEpisode'>;
/** gateway calls in flight by episode and Idempotency-Key: a retry waits for the first attempt */
type InFlight = Map<string, Promise<unknown>>;

type Obj = Record<string, unknown>;
const isObj = (v: unknown): v is Obj => typeof v === 'object' && v !== null && !Array.isArray(v);

function header(req: FastifyRequest, name: string): string | undefined {
  const v = req.headers[name];
  return typeof v === 'string' && v !== '' ? v : undefined;
}

/** The bearer token of a request, if any. */
export function bearer(req: FastifyRequest): string | undefined {
  const m = /^Bearer\s+(.+)$/i.exec(req.headers.authorization ?? '');
  return m?.[1];
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
  const params = req.params as { episode?: string; group?: string };
  const keyed = keyScope(svc, req);
  const episode = params.episode ?? header(req, 'x-treepack-episode') ?? keyed?.episode;
  if (episode === undefined) {
    throw new PoolError(400, 'no episode for this call: use a base URL /episodes/{id}/v1, the x-treepack-episode header, or an API key from POST /v1/episodes');
  }
  const agent = header(req, 'x-treepack-agent');
  const group = params.group ?? header(req, 'x-treepack-group');
  if (keyed) {
    if (episode !== keyed.episode) throw outOfScope(keyed, `not episode ${JSON.stringify(episode)}`);
    if (group !== undefined && group !== keyed.group) throw outOfScope(keyed, `its group is ${keyed.group === undefined ? 'the episode' : JSON.stringify(keyed.group)}, not ${JSON.stringify(group)}`);
    if (agent !== undefined && keyed.agent !== undefined && agent !== keyed.agent) throw outOfScope(keyed, `its agent is ${JSON.stringify(keyed.agent)}, not ${JSON.stringify(agent)}`);
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
    if (!Array.isArray(body.messages) || body.messages.length === 0) throw new PoolError(400, `field "messages": expected a non-empty list of messages, got ${describeValue(body.messages)}`);
    body.messages.forEach((m, i) => {
      if (!isObj(m)) throw new PoolError(400, `field "messages[${i}]": expected a message object, got ${describeValue(m)}`);
      if (typeof m.role !== 'string') throw new PoolError(400, `field "messages[${i}].role": expected a string (system, user, assistant, tool), got ${describeValue(m.role)}`);
    });
    if (body.tools !== undefined && body.tools !== null && !Array.isArray(body.tools)) throw new PoolError(400, `field "tools": expected a list of tool schemas, got ${describeValue(body.tools)}`);
  } else if (typeof body.prompt !== 'string') {
    throw new PoolError(400, `field "prompt": expected a string (one prompt per call is recorded), got ${describeValue(body.prompt)}`);
  }
  // The engine would coerce "yes" or 1 and stream, where the gateway reads JSON: refused, naming the field.
  if (body.stream !== undefined && body.stream !== null && typeof body.stream !== 'boolean') throw new PoolError(400, `field "stream": expected true or false, got ${describeValue(body.stream)}`);
  if (body.n !== undefined && body.n !== null && body.n !== 1) throw new PoolError(400, `field "n": the gateway records one completion per call; expected 1, got ${describeValue(body.n)}`);
  return body;
}

function policyVersion(svc: GatewayCore, req: FastifyRequest): number {
  const v = header(req, 'x-treepack-policy-version');
  if (v === undefined) return svc.feed.version;
  const n = Number(v);
  if (!Number.isSafeInteger(n) || n < 0) throw new PoolError(400, `header "x-treepack-policy-version": expected an integer >= 0, got ${JSON.stringify(v)}`);
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
  if (e.name === 'TimeoutError') return new PoolError(504, `the engine at ${svc.opts.engineUrl} did not answer within ${svc.opts.engineTimeoutMs} ms`);
  return new PoolError(502, `the engine at ${svc.opts.engineUrl} is unreachable: ${e.message}`);
}

function recordedCall(kind: CallKind, scope: Scope, body: Obj, output: EngineOutput, version: number, requestId: string | undefined): RecordedCall {
  const call: RecordedCall = { id: Pool.newId(), kind, time: Date.now(), policyVersion: version, request: {}, output };
  if (scope.agent !== undefined) call.agent = scope.agent;
  if (requestId !== undefined) call.requestId = requestId;
  if (kind === 'chat') {
    call.request.messages = body.messages as unknown[];
    if (Array.isArray(body.tools) && body.tools.length) call.request.tools = body.tools;
  } else call.request.prompt = body.prompt as string;
  return call;
}

/** The client's request id: a retry carrying the same one is answered from the call it recorded. */
function requestId(req: FastifyRequest): string | undefined {
  const v = header(req, 'idempotency-key');
  if (v !== undefined && v.length > 256) throw new PoolError(400, `header "Idempotency-Key": expected at most 256 characters, got ${v.length}`);
  return v;
}

/**
 * A recorded call as the engine's answer to a retry of it: the choice it recorded (with token ids and logprobs
 * where the client asks for them), as a body or as a stream of one chunk.
 */
function replayAnswer(kind: CallKind, call: RecordedCall, body: Obj, wants: ReturnType<typeof upstreamRequest>['wants'], reply: FastifyReply): FastifyReply {
  const o = call.output;
  const choice: Obj = { index: 0, finish_reason: o.finishReason, logprobs: null };
  if (kind === 'chat') choice.message = o.message;
  else choice.text = o.text;
  if (wants.logprobs && o.logprobs) choice.logprobs = kind === 'chat' ? { content: o.logprobs.map((logprob) => ({ logprob })) } : { token_logprobs: o.logprobs };
  if (wants.tokenIds && o.tokenIds) choice.token_ids = o.tokenIds;
  const json: Obj = { id: call.id, object: kind === 'chat' ? 'chat.completion' : 'text_completion', created: Math.floor(call.time / 1000), model: body.model ?? null, choices: [choice] };
  if (wants.tokenIds && o.promptTokenIds) json.prompt_token_ids = o.promptTokenIds;
  reply.header('x-treepack-replayed', 'true');
  if (body.stream !== true) return reply.send(json);
  if (kind === 'chat') {
    const { message, ...rest } = choice;
    json.choices = [{ ...rest, delta: message }];
    json.object = 'chat.completion.chunk';
  }
  return reply.header('content-type', 'text/event-stream').send(`data: ${JSON.stringify(json)}\n\ndata: [DONE]\n\n`);
}

/** Counts an engine failure (down, slow, garbage) before it goes back to the client. */
function countFailure(svc: GatewayCore, endpoint: string, err: unknown): never {
  if (err instanceof EngineError) svc.metrics.calls.inc({ endpoint, outcome: 'engine_garbage' });
  else if (err instanceof PoolError && err.status === 504) svc.metrics.calls.inc({ endpoint, outcome: 'engine_timeout' });
  else if (err instanceof PoolError && err.status === 502) svc.metrics.calls.inc({ endpoint, outcome: 'engine_unreachable' });
  throw err;
}

async function proxy(svc: GatewayCore, inflight: InFlight, kind: CallKind, req: FastifyRequest, reply: FastifyReply): Promise<unknown> {
  const endpoint = kind === 'chat' ? 'chat' : 'completions';
  const scope = scopeOf(svc, req);
  const body = checkBody(kind, req.body);
  const rid = requestId(req);
  if (rid === undefined) return proxyOnce(svc, kind, req, reply, scope, body, undefined).catch((err) => countFailure(svc, endpoint, err));
  // A retry while the first attempt is in flight waits for it, then is answered from its record (or tries again).
  const key = `${scope.episode}\n${rid}`;
  for (let earlier = inflight.get(key); earlier; earlier = inflight.get(key)) await earlier.catch(() => {});
  const done = proxyOnce(svc, kind, req, reply, scope, body, rid);
  inflight.set(key, done);
  try {
    return await done;
  } catch (err) {
    return countFailure(svc, endpoint, err);
  } finally {
    if (inflight.get(key) === done) inflight.delete(key); // a retry that waited may hold it by now
  }
}

async function proxyOnce(svc: GatewayCore, kind: CallKind, req: FastifyRequest, reply: FastifyReply, scope: Scope, body: Obj, rid: string | undefined): Promise<unknown> {
  const endpoint = kind === 'chat' ? 'chat' : 'completions';
  const t0 = performance.now();
  const version = policyVersion(svc, req);
  const { body: up, wants } = upstreamRequest(kind, body);
  const recorded = rid === undefined ? undefined : svc.pool.episodes.get(scope.episode)?.requests?.get(rid);
  if (recorded) {
    svc.metrics.calls.inc({ endpoint, outcome: 'replayed' });
    return replayAnswer(kind, recorded, body, wants, reply);
  }
  svc.admit();
  svc.pool.checkCall(scope.episode, scope.group);
  await svc.openEpisode(scope.episode, scope.group);
  const tEngine = performance.now();
  const res = await callEngine(svc, kind, up);
  if (res.status < 200 || res.status >= 300) {
    // The engine's own refusal (bad parameters, overload) goes back as it is, and nothing is recorded.
    svc.metrics.calls.inc({ endpoint, outcome: `engine_${res.status}` });
    const text = await res.text().catch((err: Error) => Promise.reject(engineFailure(svc, err)));
    return reply.code(res.status).header('content-type', res.contentType ?? 'application/json').send(text);
  }
  const commit = async (output: EngineOutput) => {
    await svc.commit({ type: 'call', episode: scope.episode, group: scope.group, call: recordedCall(kind, scope, body, output, version, rid) });
    svc.metrics.calls.inc({ endpoint, outcome: 'recorded' });
  };
  if (body.stream !== true) {
    let json: unknown;
    const text = await res.text().catch((err: Error) => Promise.reject(engineFailure(svc, err)));
    const tBack = performance.now();
    svc.metrics.engine.observe({ endpoint }, (tBack - tEngine) / 1000);
    try {
      json = JSON.parse(text);
    } catch {
      throw new EngineError(`expected JSON, got ${describeValue(text)}`);
    }
    await commit(parseResponse(kind, json));
    svc.metrics.latency.observe({ endpoint }, (performance.now() - tBack + (tEngine - t0)) / 1000);
    return reply.send(clientView(json as Obj, wants));
  }
  return stream(svc, kind, res, reply, wants, commit, { t0, tEngine, endpoint });
}

async function stream(
  svc: GatewayCore,
  kind: CallKind,
  res: Upstream,
  reply: FastifyReply,
  wants: ReturnType<typeof upstreamRequest>['wants'],
  commit: (o: EngineOutput) => Promise<void>,
  t: { t0: number; tEngine: number; endpoint: string },
): Promise<void> {
  const acc = new StreamAccumulator(kind);
  let done = false;
  let failure: Error | undefined;
  const out: string[] = [];
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
        out.push(`data: ${JSON.stringify(clientView(chunk as Obj, wants))}\n\n`);
      } catch (err) {
        failure = err instanceof EngineError ? err : new EngineError(`stream event is not JSON: ${describeValue(ev.data)}`);
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
      if (out.length) raw.write(out.splice(0).join(''));
      if (failure) break;
    }
  } catch (err) {
    failure ??= res.timedOut() ? new EngineError(`the engine's stream did not end within ${svc.opts.engineTimeoutMs} ms (--engine-timeout)`) : new EngineError(`the engine's stream broke: ${(err as Error).message}`);
  }
  const tBack = performance.now();
  if (!failure && !done) failure = new EngineError('the engine closed the stream without data: [DONE]');
  if (!failure) {
    try {
      await commit(acc.result());
    } catch (err) {
      failure = err as Error;
    }
  }
  if (failure) {
    // Headers are gone: the error travels as an SSE event, and [DONE] is withheld so the client sees a failure.
    svc.metrics.calls.inc({ endpoint: t.endpoint, outcome: res.timedOut() ? 'engine_timeout' : 'engine_garbage' });
    raw.end(`data: ${JSON.stringify({ error: { message: failure.message, type: 'engine_error' } })}\n\n`);
    return;
  }
  svc.metrics.latency.observe({ endpoint: t.endpoint }, (performance.now() - tBack + (t.tEngine - t.t0)) / 1000);
  raw.end('data: [DONE]\n\n');
}

function finishBody(body: unknown): { reward: number; metadata?: Obj; group_size?: number } {
  if (!isObj(body)) throw new PoolError(400, `request body: expected a JSON object {"reward": number, "metadata"?: object}, got ${describeValue(body)}`);
  if (typeof body.reward !== 'number' || !Number.isFinite(body.reward)) throw new PoolError(400, `field "reward": expected a finite number, got ${describeValue(body.reward)}`);
  const out: { reward: number; metadata?: Obj; group_size?: number } = { reward: body.reward };
  if (body.metadata !== undefined && body.metadata !== null) {
    if (!isObj(body.metadata)) throw new PoolError(400, `field "metadata": expected an object, got ${describeValue(body.metadata)}`);
    out.metadata = body.metadata;
  }
  if (body.group_size !== undefined && body.group_size !== null) {
    if (!Number.isSafeInteger(body.group_size) || (body.group_size as number) < 1) throw new PoolError(400, `field "group_size": expected an integer >= 1, got ${describeValue(body.group_size)}`);
    out.group_size = body.group_size as number;
  }
  return out;
}

const NO_CALL = 'finished without a call';

/** Routes a scoped API key may use (its own episode's, checked by the route): every other route refuses it. */
export const SCOPED = { config: { scoped: true } };

/** The group an episode counts toward: its own, or where no call made it yet, the key's or the request's. */
function groupOf(svc: GatewayCore, episode: string, given: string | undefined): string {
  return svc.pool.episodes.get(episode)?.group ?? given ?? svc.pool.keyed.get(episode)?.group ?? episode;
}

function groupAnswer(svc: GatewayCore, group: string, shared: SharedGroup | undefined) {
  const g = svc.pool.groups.get(group)!;
  // On the shared pool the group's other episodes may come through other gateways: Redis counts them.
  const episodes = shared === undefined ? (svc.shared ? null : g.finished + g.abandoned) : 'episodes' in shared ? shared.episodes : null;
  return { group: g.id, group_finished: g.complete || (episodes !== null && episodes >= g.size), group_episodes: episodes, group_size: g.size };
}

export function registerGateway(app: FastifyInstance, svc: GatewayCore): void {
  const inflight: InFlight = new Map();
  for (const prefix of ['', '/episodes/:episode', '/groups/:group/episodes/:episode']) {
    app.post(`${prefix}/v1/chat/completions`, SCOPED, (req, reply) => proxy(svc, inflight, 'chat', req, reply));
    app.post(`${prefix}/v1/completions`, SCOPED, (req, reply) => proxy(svc, inflight, 'completion', req, reply));
    // The episode's base URL serves the model list too (openai's client.models.list()), with the engine's key.
    app.get(`${prefix}/v1/models`, SCOPED, async (req, reply) => {
      if (req.params && (req.params as { episode?: string }).episode !== undefined) scopeOf(svc, req);
      const headers: Record<string, string> = svc.opts.engineApiKey ? { authorization: `Bearer ${svc.opts.engineApiKey}` } : {};
      const res = await fetch(`${svc.opts.engineUrl}/models`, { headers, signal: AbortSignal.timeout(svc.opts.engineTimeoutMs) }).catch((err: Error) => {
        throw engineFailure(svc, err);
      });
      return reply.code(res.status).header('content-type', 'application/json').send(await res.text());
    });
  }

  /** A scoped API key for one episode (and agent, group): the agent's only configuration. */
  app.post('/v1/episodes', async (req) => {
    const b = (req.body ?? {}) as unknown;
    if (!isObj(b)) throw new PoolError(400, `request body: expected a JSON object, got ${describeValue(b)}`);
    for (const f of ['episode_id', 'agent', 'group'] as const) {
      if (b[f] !== undefined && (typeof b[f] !== 'string' || b[f] === '')) throw new PoolError(400, `field "${f}": expected a non-empty string, got ${describeValue(b[f])}`);
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
    return { episode_id: ep.id, group: ep.group, agents: [...ep.agents], finished: ep.finished, abandoned: ep.abandoned ?? null, reward: ep.reward ?? null, metadata: ep.metadata ?? null, calls: ep.calls };
  });

  /** The episode as the JSONL records the trainer feed packs (what `treepack pack` would read for it). */
  app.get('/v1/episodes/:id/records', async (req, reply) => {
    const { id } = req.params as { id: string };
    const ep = svc.pool.episodes.get(id);
    if (!ep) throw new PoolError(404, `unknown episode ${JSON.stringify(id)}`);
    if (svc.pool.groups.get(ep.group)!.consumed) throw new PoolError(410, `episode ${JSON.stringify(id)} was consumed; its records are in the log only`);
    if (ep.shipped) throw new PoolError(410, `episode ${JSON.stringify(id)} was shipped to the shared pool; its records are in the log only`);
    const lines = episodeLines(ep, svc.encoder, emptyRecordStats());
    return reply.header('content-type', 'application/x-ndjson').send(lines.map((l) => JSON.stringify(l) + '\n').join(''));
  });

  /**
   * Ends an episode with its reward. A retry with the same reward and metadata is answered as the first was; an
   * episode under which no call was recorded (its agent crashed first) is abandoned: nothing of it can train.
   */
  app.post('/v1/episodes/:id/finish', SCOPED, async (req) => {
    const { id } = req.params as { id: string };
    confine(svc, req, id);
    const b = finishBody(req.body);
    const ep = svc.pool.episodes.get(id);
    if (ep?.finished && ep.reward === b.reward && jsonEqual(ep.metadata ?? null, b.metadata ?? null) && (b.group_size === undefined || b.group_size === svc.pool.groups.get(ep.group)!.size)) {
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
    if (!isObj(b) || (b.group !== undefined && (typeof b.group !== 'string' || b.group === ''))) throw new PoolError(400, `request body: expected {"group"?: string}, got ${describeValue(b)}`);
    const key = keyScope(svc, req);
    if (key && b.group !== undefined && b.group !== key.group) throw outOfScope(key, `not group ${JSON.stringify(b.group)}`);
    return abandon(svc, id, groupOf(svc, id, b.group as string | undefined), 'abandoned');
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
