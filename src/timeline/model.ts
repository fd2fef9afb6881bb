/**
 * Timelines: one LLM call as the ordered messages of its context plus the answer, each message with its author,
 * identity, token ids, loss mask and rollout logprobs. This is the unit the timeline merge works on (AgentJet's
 * `List[ExtendedMessage]`), one step before token sequences.
 */
import { argError } from '../errors.js';
import type { Author, Source } from '../records/types.js';

export type { Author } from '../records/types.js';
export { AUTHORS } from '../records/types.js';

/** One message of a timeline: its author, text, tokens and per-token loss mask and logprobs. */
export interface TimelineMessage {
  author: Author;
  role: string; // '' for messages of pre-tokenized samples, which carry tokens only
  /**
   * What the message says, for `timelineCompareLevel: 'text'`: role, content, reasoning, tool calls (name,
   * arguments, id), tool_call_id and name. Undefined for pre-tokenized messages, which compare by tokens.
   */
  text: string | undefined;
  /** Tool calls as rendered identity (part of the message's identity in both compare levels); '' when none. */
  calls: string;
  tokens: Int32Array;
  lossMask: Uint8Array;
  /** Rollout logprob per token (meaningful where lossMask is 1); absent when the record gave none. */
  logprobs?: Float32Array;
}

/** The ordered messages of one call, with the ids of the record, its group and episode: what the timeline merge compares. */
export interface Timeline {
  id: string;
  group: string;
  episode: string;
  agent?: string;
  reward?: number;
  advantage?: number;
  /** The request's tool schemas as canonical JSON; '' when none. Compared only when `ignoreTools` is false. */
  tools: string;
  messages: TimelineMessage[];
  source: Source;
}

/** AgentJet's `timeline_merging_policy` and context-tracker switches, with its defaults. */
export interface MergeOptions {
  /** 'text' (default): messages compare by what they say; 'token': by their token ids. */
  timelineCompareLevel?: 'text' | 'token';
  /** Ignore differences in the request's tool schemas (default true). */
  ignoreTools?: boolean;
  /**
   * The engine's tokens win over re-rendered ones (default true): a response's `token_ids` replace its rendering,
   * and a generated message's sampled tokens replace its re-rendered copies in later contexts of its episode.
   */
  fixRetokenizationDrift?: boolean;
  /** Report contexts that extend no earlier context of their episode (default false). */
  detectTimelineSnap?: boolean;
  /** Merge timelines of different agents of one episode (default false: each agent on its own). */
  shareAcrossAgents?: boolean;
}

export type ResolvedMergeOptions = Required<MergeOptions>;

/** The merge options with their defaults filled in; a bad value throws E_ARG naming it. */
export function mergeDefaults(o: MergeOptions = {}): ResolvedMergeOptions {
  const level = o.timelineCompareLevel;
  if (level !== undefined && level !== 'text' && level !== 'token') throw argError('timelineCompareLevel', "'text' or 'token'", level);
  return {
    timelineCompareLevel: o.timelineCompareLevel ?? 'text',
    ignoreTools: o.ignoreTools ?? true,
    fixRetokenizationDrift: o.fixRetokenizationDrift ?? true,
    detectTimelineSnap: o.detectTimelineSnap ?? false,
    shareAcrossAgents: o.shareAcrossAgents ?? false,
  };
}

export function timelineLength(t: Timeline): number {
  let n = 0;
  for (const m of t.messages) n += m.tokens.length;
  return n;
}
