/**
 * A finished episode as the JSONL records `treepack pack` reads (docs/guides/packing.md, "Input formats"), so the service and the
 * CLI pack the very same input: one chat-episode line with every call whose context the chat template renders
 * to the engine's own prompt tokens (the response carries the engine's `token_ids` and `logprobs`), and one
 * pre-tokenized sample line per call where it does not (drift: the engine's prompt and generated ids, trained
 * on the generated part with their logprobs), so training always sees the tokens the engine saw. Calls without
 * engine ids are rendered by the template (the fallback). A /v1/completions call needs the engine's ids. A call
 * whose output carries the experts the engine routed its tokens to (routed-experts.ts) is a sample too, with
 * `routes` over its prompt and generated tokens: the packer reads routes from pre-tokenized samples, where they
 * line up with the engine's own tokens. Where its prompt is the template's, it keeps the call's message boundaries
 * and authors (`message_offsets`, `message_authors`: its turns, as the chat line would have them). Such a sample
 * passes the timeline merge untouched (src/timeline/build.ts): calls share their common prefix in the forest
 * instead, and only where their routes agree (src/pack/routes.ts), so no token is trained on another call's route.
 * A call with images (their data URLs: images.ts) trains from its chat
 * record only, where the images go with their placeholders: one whose engine prompt is not the template's, with
 * each image expanded into the placeholders the served processor makes of it, cannot be trained with its images
 * and fails to pack (its episode is quarantined: packing.ts).
 */
import { TreepackError } from '../errors.js';
import { parseRecords } from '../records/read.js';
import type { Author, ChatRecord } from '../records/types.js';
import { timelineFromChat } from '../timeline/build.js';
import { mergeDefaults } from '../timeline/model.js';
import type { ChatEncoder } from '../tokenize/chat.js';
import { processImage } from '../tokenize/images.js';
import type { EngineOutput } from './engine.js';
import type { Episode, RecordedCall } from './pool.js';

export interface RecordStats {
  /** calls whose prompt the template reproduced token for token */
  promptMatched: number;
  /** calls trained from the engine's ids because the template rendered another prompt */
  promptDrifted: number;
  /** calls rendered by the template: the engine returned no ids */
  rendered: number;
  /** calls that cannot be trained: a completion without the engine's ids, or no generated tokens */
  skipped: number;
}

export const emptyRecordStats = (): RecordStats => ({ promptMatched: 0, promptDrifted: 0, rendered: 0, skipped: 0 });

type Line = Record<string, unknown>;

function sameIds(a: ArrayLike<number>, b: ArrayLike<number>): boolean {
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
  return true;
}

/** The prompt the template renders for a chat record: every turn before the response, and its header. */
function renderedPrompt(encoder: ChatEncoder, rec: ChatRecord): Int32Array {
  const turns = encoder.encodeTurns(rec);
  const last = turns.ids[turns.ids.length - 1];
  let n = turns.trainableFrom;
  for (let i = 0; i < turns.ids.length - 1; i++) n += turns.ids[i].length;
  const out = new Int32Array(n);
  let at = 0;
  for (let i = 0; i < turns.ids.length - 1; i++) {
    out.set(turns.ids[i], at);
    at += turns.ids[i].length;
  }
  out.set(last.subarray(0, turns.trainableFrom), at);
  return out;
}

/**
 * Where each message of a chat call starts in its rendered tokens, and its author, as the timeline merge reads the
 * call (timelineFromChat; a message the template renders inside the previous one's turn, such as a second tool
 * answer, is part of that message). Undefined where the template renders no turn per message, as the merge refuses.
 */
function messageBoundaries(rec: ChatRecord, encoder: ChatEncoder): { offsets: number[]; authors: Author[] } | undefined {
  let messages;
  try {
    messages = timelineFromChat(rec, encoder, mergeDefaults()).timeline.messages;
  } catch (err) {
    if (err instanceof TreepackError && err.code === 'E_INPUT') return undefined;
    throw err;
  }
  const offsets: number[] = [];
  const authors: Author[] = [];
  let at = 0;
  for (const m of messages) {
    if (m.tokens.length === 0) continue;
    offsets.push(at);
    authors.push(m.author);
    at += m.tokens.length;
  }
  return { offsets, authors };
}

/**
 * The prompt the engine sees for a record with images: `prompt` (the template's, one placeholder token per image)
 * with each image's placeholder repeated as many times as the served processor expands it.
 */
function expandedPrompt(encoder: ChatEncoder, rec: ChatRecord, prompt: Int32Array): { ids: Int32Array; images: number } {
  const proc = encoder.tokenizer.imageProcessor!;
  const counts = rec.messages
    .flatMap((m) => m.parts ?? [])
    .flatMap((p) => (p.type === 'image' ? [processImage(p.image, proc).tokens] : []));
  const out: number[] = [];
  let k = 0;
  for (const t of prompt) {
    if (t === proc.image_token_id && k < counts.length) for (let n = counts[k++]; n > 0; n--) out.push(t);
    else out.push(t);
  }
  return { ids: Int32Array.from(out), images: counts.reduce((a, b) => a + b, 0) };
}

/** Why a call with images cannot be trained: its engine prompt is not the template's with the images expanded. */
function imageDrift(encoder: ChatEncoder, ep: Episode, call: number, expected: number, engine: Int32Array | number[]): TreepackError {
  const proc = encoder.tokenizer.imageProcessor!;
  let got = 0;
  for (const t of engine) if (t === proc.image_token_id) got++;
  const why =
    got !== expected
      ? `the engine's prompt has ${got} image placeholder tokens (id ${proc.image_token_id}) where the ${proc.family} processor ` +
        `of the served tokenizer (${encoder.tokenizer.name}) expands the call's images into ${expected}: the engine serves other ` +
        'image processor settings (min_pixels, max_pixels, patch or merge size) than the tokenizer directory has'
      : "the engine's prompt is not the chat template's rendering of the call";
  return new TreepackError('E_INPUT', `${why}; a call with images trains only on the prompt the engine saw`, {
    file: 'episode ' + ep.id,
    line: call + 1,
    field: 'prompt_token_ids',
  });
}

function engineSample(ep: Episode, id: string, call: RecordedCall, out: EngineOutput, rec?: ChatRecord, encoder?: ChatEncoder): Line {
  const prompt = out.promptTokenIds!;
  const gen = out.tokenIds!;
  const line: Line = {
    id, // apart from the episode line's `${episode}/${request index}`
    episode: ep.id,
    group: ep.group,
    tokens: [...prompt, ...gen],
    loss_mask: [...new Array<number>(prompt.length).fill(0), ...new Array<number>(gen.length).fill(1)],
  };
  const lp = out.logprobs;
  if (lp && lp.length === gen.length) line.rollout_logprobs = [...new Array<number>(prompt.length).fill(0), ...lp];
  if (out.routes) line.routes = out.routes;
  const bounds = rec && encoder && messageBoundaries(rec, encoder);
  if (bounds) {
    line.message_offsets = bounds.offsets;
    line.message_authors = bounds.authors;
  }
  if (call.agent !== undefined) line.agent = call.agent;
  if (ep.reward !== undefined) line.reward = ep.reward;
  return line;
}

/**
 * The records of one finished episode, in call order; `encoder` checks engine prompts against the template. The
 * choices of a call with n > 1 follow one another, each a request (or sample) of its own: they share the prompt,
 * so the packer makes each one more branch of the episode's tree.
 */
export function episodeLines(ep: Episode, encoder: ChatEncoder, stats: RecordStats): Line[] {
  if (ep.direct) return [directLine(ep)];
  const requests: Line[] = [];
  const samples: Line[] = [];
  ep.calls.forEach((call, k) => {
    [call.output, ...(call.siblings ?? [])].forEach((out, j) => {
      // choice 0 keeps the names of a call with one choice
      const sampleId = j === 0 ? `${ep.id}/s${k}` : `${ep.id}/s${k}.${j}`;
      const hasIds = out.promptTokenIds !== undefined && out.tokenIds !== undefined && out.tokenIds.length > 0;
      if (call.kind === 'completion' || !out.message) {
        if (hasIds) samples.push(engineSample(ep, sampleId, call, out));
        else stats.skipped++;
        return;
      }
      const response: Line = { ...out.message };
      if (out.tokenIds && out.tokenIds.length > 0) {
        response.token_ids = out.tokenIds;
        if (out.logprobs && out.logprobs.length === out.tokenIds.length) response.logprobs = out.logprobs;
      }
      const req: Line = { messages: call.request.messages ?? [], response };
      if (call.request.tools && call.request.tools.length) req.tools = call.request.tools;
      if (call.agent !== undefined) req.agent = call.agent;
      if (hasIds) {
        const [rec] = parseRecords(
          { ...req, id: `${ep.id}/${k}`, episode: ep.id, group: ep.group },
          { file: 'episode ' + ep.id, line: k + 1 },
        ) as ChatRecord[];
        const withImages = rec.messages.some((m) => m.parts?.some((p) => p.type === 'image'));
        const rendered = renderedPrompt(encoder, rec);
        const expanded = withImages ? expandedPrompt(encoder, rec, rendered) : undefined;
        const matched = sameIds(expanded?.ids ?? rendered, out.promptTokenIds!);
        // the engine's tokens as a sample would train on its placeholders without the images
        if (!matched && expanded) throw imageDrift(encoder, ep, k, expanded.images, out.promptTokenIds!);
        if (expanded && out.routes)
          throw new TreepackError('E_INPUT', 'routed experts of a call with images: a pre-tokenized sample carries no images', {
            file: 'episode ' + ep.id,
            line: k + 1,
            field: 'routed_experts',
          });
        if (matched) stats.promptMatched++;
        else stats.promptDrifted++;
        if (!matched || out.routes) {
          // the template's boundaries are the engine's only where it rendered the engine's prompt
          samples.push(matched ? engineSample(ep, sampleId, call, out, rec, encoder) : engineSample(ep, sampleId, call, out));
          return;
        }
      } else stats.rendered++;
      requests.push(req);
    });
  });
  const lines: Line[] = [];
  if (requests.length) {
    const meta: Line = { ...(ep.metadata ?? {}) };
    if (ep.reward !== undefined) meta.reward = ep.reward;
    lines.push({ episode_id: ep.id, task_id: ep.group, meta, requests });
  }
  return lines.concat(samples);
}

/** A slime record (uid, instance_id, messages, reward): the last assistant message is the response. */
function directLine(ep: Episode): Line {
  const r = ep.direct!;
  const messages = (r.messages as Line[]).slice();
  const response = messages.pop();
  return { id: ep.id, episode: ep.id, group: ep.group, messages, response, reward: ep.reward };
}
