/**
 * Records → timelines, and a timeline back to a sample. A chat record's tokens come from the chat template cut
 * at turn starts (ChatEncoder.encodeTurns): one turn per message, except that a run of tool messages shares one
 * turn (ChatML folds them into one user turn; the turn goes to the first) and a preamble turn (Qwen3's tool list
 * without a system message) goes to the first message. Templates that render turns another way are rejected
 * rather than guessed at: a wrong split would merge the wrong tokens.
 */
import { TreepackError } from '../errors.js';
import type { ChatMessage, ChatRecord, Sample } from '../records/types.js';
import type { ChatEncoder } from '../tokenize/chat.js';
import { engineTokens } from './drift.js';
import { timelineLength, type Author, type ResolvedMergeOptions, type Timeline, type TimelineMessage } from './model.js';

/**
 * Per-token fields a timeline cannot carry: samples with them pass the merge untouched (routes: a sample's routes
 * share only where they agree, which the forest decides, src/pack/routes.ts).
 */
const UNMERGEABLE_FIELDS = ['old_logprobs', 'ref_logprobs', 'advantages', 'routes'] as const;

export interface Built {
  timeline: Timeline;
  drifted: boolean; // the engine's tokens differed from the re-rendered response
}

function callsIdentity(m: ChatMessage): string {
  if (!m.tool_calls) return '';
  return m.tool_calls
    .map(
      (c) =>
        `${c.id ?? ''}\u0002${c.function.name}\u0002${typeof c.function.arguments === 'string' ? c.function.arguments : JSON.stringify(c.function.arguments)}`,
    )
    .join('\u0003');
}

function textIdentity(m: ChatMessage, calls: string): string {
  return `${m.role}\u0000${m.name ?? ''}\u0000${m.tool_call_id ?? ''}\u0000${m.reasoning_content ?? ''}\u0000${calls}\u0000${m.content ?? ''}`;
}

function contextAuthor(m: ChatMessage, i: number): Author {
  switch (m.role) {
    case 'system':
      return i === 0 ? 'initialization' : 'system';
    case 'user':
      return 'user';
    case 'tool':
      return 'tool';
    default:
      return 'env'; // earlier assistant turns: generated once, context now
  }
}

/** The timeline of a chat record: its messages and response encoded through `encoder`, the response trainable. */
export function timelineFromChat(record: ChatRecord, encoder: ChatEncoder, opts: ResolvedMergeOptions): Built {
  const where = (field: string) => ({ file: record.source.file, line: record.source.line, record: record.id, field });
  const messages = [...record.messages, record.response];
  const n = messages.length;
  const opens = new Uint8Array(n);
  let turnsExpected = 0;
  for (let i = 0; i < n; i++) {
    const m = messages[i];
    if (m.role === 'tool' && (m.tool_call_id === undefined || m.tool_call_id === ''))
      throw new TreepackError('E_INPUT', 'a tool message needs the id of the call it answers', where(`messages[${i}].tool_call_id`));
    if (!(m.role === 'tool' && i > 0 && messages[i - 1].role === 'tool')) {
      opens[i] = 1;
      turnsExpected++;
    }
  }
  const turns = encoder.encodeTurns(record);
  const preamble = turns.ids.length - turnsExpected;
  if (preamble !== 0 && preamble !== 1) {
    throw new TreepackError(
      'E_INPUT',
      `the chat template renders ${turns.ids.length} turns for ${n} messages (roles ${messages.map((m) => m.role).join(', ')}); ` +
        'timeline merging needs one turn per message (use --no-merge for this template)',
      where('messages'),
    );
  }
  const out: TimelineMessage[] = new Array<TimelineMessage>(n);
  let turn = preamble;
  let drifted = false;
  for (let i = 0; i < n; i++) {
    const m = messages[i];
    const calls = callsIdentity(m);
    const text = textIdentity(m, calls);
    let tokens = opens[i] ? turns.ids[turn++] : new Int32Array(0);
    if (i === 0 && preamble) {
      const joined = new Int32Array(turns.ids[0].length + tokens.length);
      joined.set(turns.ids[0]);
      joined.set(tokens, turns.ids[0].length);
      tokens = joined;
    }
    if (i < n - 1) {
      out[i] = { author: contextAuthor(m, i), role: m.role, text, calls, tokens, lossMask: new Uint8Array(tokens.length) };
      continue;
    }
    const offset = i === 0 ? tokens.length - turns.ids[turns.ids.length - 1].length : 0;
    const r = engineTokens(
      tokens,
      offset + turns.trainableFrom,
      offset + turns.trainableTo,
      m,
      opts.fixRetokenizationDrift,
      where('response.logprobs'),
    );
    drifted = r.drifted;
    out[i] = { author: 'llm', role: m.role, text, calls, tokens: r.tokens, lossMask: r.lossMask };
    if (r.logprobs) out[i].logprobs = r.logprobs;
  }
  const timeline: Timeline = {
    id: record.id,
    group: record.group,
    episode: record.episode,
    tools: opts.ignoreTools || !record.tools || record.tools.length === 0 ? '' : JSON.stringify(record.tools),
    messages: out,
    source: record.source,
  };
  if (record.agent !== undefined) timeline.agent = record.agent;
  if (record.reward !== undefined) timeline.reward = record.reward;
  return { timeline, drifted };
}

/** A pre-tokenized sample with message boundaries as a timeline; undefined for one the merge must pass through. */
export function timelineFromSample(s: Sample): Timeline | undefined {
  const offsets = s.message_offsets;
  if (!offsets || UNMERGEABLE_FIELDS.some((f) => s[f] !== undefined)) return undefined;
  const messages: TimelineMessage[] = new Array<TimelineMessage>(offsets.length);
  for (let i = 0; i < offsets.length; i++) {
    const from = offsets[i],
      to = i + 1 < offsets.length ? offsets[i + 1] : s.tokens.length;
    const lossMask = s.loss_mask.subarray(from, to);
    const m: TimelineMessage = {
      author: s.message_authors?.[i] ?? (lossMask.includes(1) ? 'llm' : 'env'),
      role: '',
      text: undefined,
      calls: '',
      tokens: s.tokens.subarray(from, to),
      lossMask,
    };
    if (s.rollout_logprobs) m.logprobs = s.rollout_logprobs.subarray(from, to);
    messages[i] = m;
  }
  const t: Timeline = { id: s.id, group: s.group, episode: s.episode, tools: '', messages, source: s.source };
  if (s.agent !== undefined) t.agent = s.agent;
  if (s.reward !== undefined) t.reward = s.reward;
  if (s.advantage !== undefined) t.advantage = s.advantage;
  return t;
}

/**
 * A timeline's messages as one sample, with where its turns (its 'llm' messages) start (src/pack/turns.ts). Rollout
 * logprobs are kept when every trainable message has them; a sample mixing messages with and without them would
 * need a placeholder in trainable positions, so it is rejected.
 */
export function timelineToSample(t: Timeline, messages: readonly TimelineMessage[] = t.messages): Sample {
  const total = messages === t.messages ? timelineLength(t) : messages.reduce((a, m) => a + m.tokens.length, 0);
  const tokens = new Int32Array(total);
  const loss_mask = new Uint8Array(total);
  let logprobs: Float32Array | undefined;
  let withLp: TimelineMessage | undefined, without: TimelineMessage | undefined;
  for (const m of messages) {
    if (!m.lossMask.includes(1)) continue;
    if (m.logprobs) withLp ??= m;
    else without ??= m;
  }
  if (withLp && without) {
    throw new TreepackError(
      'E_INPUT',
      'some generated messages of this sample have rollout logprobs and some have none; give them for every response of the episode or none',
      {
        file: t.source.file,
        line: t.source.line,
        record: t.id,
        field: 'logprobs',
      },
    );
  }
  if (withLp) logprobs = new Float32Array(total);
  const turns: number[] = [];
  let at = 0;
  for (const m of messages) {
    if (m.author === 'llm') turns.push(at);
    tokens.set(m.tokens, at);
    loss_mask.set(m.lossMask, at);
    if (logprobs && m.logprobs) logprobs.set(m.logprobs, at);
    at += m.tokens.length;
  }
  if (total > 0) loss_mask[0] = 0;
  const s: Sample = {
    kind: 'sample',
    id: t.id,
    group: t.group,
    episode: t.episode,
    tokens,
    loss_mask,
    turn_starts: Int32Array.from(turns),
    source: t.source,
  };
  if (t.agent !== undefined) s.agent = t.agent;
  if (t.reward !== undefined) s.reward = t.reward;
  if (t.advantage !== undefined) s.advantage = t.advantage;
  if (logprobs) s.rollout_logprobs = logprobs;
  return s;
}
