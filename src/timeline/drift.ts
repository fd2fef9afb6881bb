/**
 * Retokenization drift: re-rendering a generated message through the chat template need not give the tokens the
 * engine sampled (Qwen3 drops the empty think block once a turn is no longer last; BPE may split differently than
 * the sampler chose). The sampled tokens are what the rollout logprobs belong to, so they win:
 *  - a response's engine `token_ids` replace its rendered generated tokens (engineTokens);
 *  - a generated message's sampled tokens replace its re-rendered copies in later contexts (sampledVersions).
 */
import { TreepackError } from '../errors.js';
import type { ChatMessage, Source } from '../records/types.js';
import type { TimelineMessage } from './model.js';

function sameTokens(a: Int32Array, b: Int32Array): boolean {
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
  return true;
}

export interface EngineResponse {
  tokens: Int32Array;
  lossMask: Uint8Array;
  logprobs?: Float32Array;
  drifted: boolean;
}

/**
 * The response turn with the engine's tokens: `rendered` is the turn as re-rendered, [from, to) its generated
 * part. With `fix` off the rendered tokens stay, and the engine's logprobs must then fit them.
 */
export function engineTokens(
  rendered: Int32Array,
  from: number,
  to: number,
  response: ChatMessage,
  fix: boolean,
  where: Source & { record: string; field: string },
): EngineResponse {
  const engine = response.token_ids;
  const drifted = engine !== undefined && !sameTokens(engine, rendered.subarray(from, to));
  const useEngine = drifted && fix;
  const generated = useEngine ? engine.length : to - from;
  const tokens = useEngine ? new Int32Array(rendered.length - (to - from) + generated) : rendered.slice();
  if (useEngine) {
    tokens.set(rendered.subarray(0, from));
    tokens.set(engine, from);
    tokens.set(rendered.subarray(to), from + generated);
  }
  const lossMask = new Uint8Array(tokens.length).fill(1, from, from + generated);
  const out: EngineResponse = { tokens, lossMask, drifted };
  const lp = response.logprobs;
  if (lp) {
    if (lp.length !== generated) {
      const why = drifted
        ? `the engine's token_ids differ from the re-rendered response (${to - from} tokens) and fixRetokenizationDrift is off, so its ${lp.length} logprobs fit no trained token`
        : `expected one logprob per generated token (${generated}), got ${lp.length}`;
      throw new TreepackError('E_INPUT', why, { file: where.file, line: where.line, record: where.record, field: where.field });
    }
    out.logprobs = new Float32Array(tokens.length);
    out.logprobs.set(lp, from);
  }
  return out;
}

/** A fixed order on sampled versions (tokens, then mask, then logprobs, element by element); 0 when equal. */
export function compareVersions(a: TimelineMessage, b: TimelineMessage): number {
  if (a === b) return 0;
  const arrays: [ArrayLike<number> | undefined, ArrayLike<number> | undefined][] = [
    [a.tokens, b.tokens],
    [a.lossMask, b.lossMask],
    [a.logprobs, b.logprobs],
  ];
  for (const [x, y] of arrays) {
    if (x === undefined || y === undefined) {
      if (x !== y) return x === undefined ? -1 : 1;
      continue;
    }
    if (x.length !== y.length) return x.length - y.length;
    for (let i = 0; i < x.length; i++) if (x[i] !== y[i]) return x[i] < y[i] ? -1 : 1;
  }
  return 0;
}

/**
 * Per trie node, the sampled version of its message: among the `llm` messages at the node, the smallest under
 * compareVersions (any fixed rule makes the choice independent of input order); undefined where nothing was
 * sampled. Most nodes hold one sampled message, so comparisons are rare.
 */
export function sampledVersions(
  nodes: number,
  visit: (f: (node: number, m: TimelineMessage) => void) => void,
): (TimelineMessage | undefined)[] {
  const chosen: (TimelineMessage | undefined)[] = new Array<TimelineMessage | undefined>(nodes);
  visit((n, m) => {
    if (m.author === 'llm' && (chosen[n] === undefined || compareVersions(m, chosen[n]) < 0)) chosen[n] = m;
  });
  return chosen;
}

/** Messages (trie nodes) whose re-rendered context copies differ from the tokens sampled for them. */
export function countContextDrift(
  chosen: readonly (TimelineMessage | undefined)[],
  visit: (f: (node: number, m: TimelineMessage) => void) => void,
): number {
  const drifted = new Uint8Array(chosen.length);
  let count = 0;
  visit((n, m) => {
    const s = chosen[n];
    if (!s || m.author === 'llm' || drifted[n] || sameTokens(s.tokens, m.tokens)) return;
    drifted[n] = 1;
    count++;
  });
  return count;
}
