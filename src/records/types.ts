/** What the readers produce: chat records (to be tokenized) and samples (already token ids). */

/** Where a record came from, for error messages: file name (or "-") and 1-based line. */
export interface Source {
  file: string;
  line: number;
}

/** A tool call of an assistant message, as OpenAI's chat format writes it. */
export interface ToolCall {
  id?: string;
  type?: string;
  function: { name: string; arguments: string | Record<string, unknown> };
}

/** An OpenAI chat message. `content` may be null on assistant messages that only call tools. */
export interface ChatMessage {
  role: string;
  content: string | null;
  tool_calls?: ToolCall[];
  tool_call_id?: string;
  name?: string;
  reasoning_content?: string;
  /** Response only: the tokens the inference engine generated (after the assistant header, end-of-turn included). */
  token_ids?: Int32Array;
  /** Response only: the engine's logprob of each generated token (of `token_ids`, else of the rendered response). */
  logprobs?: Float32Array;
}

/** One LLM call: the context sent (`messages`, `tools`) and the answer the policy generated (`response`). */
export interface ChatRecord {
  kind: 'chat';
  id: string; // unique within the input: `${episode}/${k}` for episodes
  group: string; // GRPO group (task id)
  episode: string; // the trajectory this call belongs to
  agent?: string;
  reward?: number;
  messages: ChatMessage[];
  tools?: unknown[] | null;
  response: ChatMessage;
  source: Source;
}

/** Who wrote a timeline message: the policy (`llm`, trainable) or the context around it. */
export type Author = 'llm' | 'user' | 'env' | 'tool' | 'system' | 'initialization';
/** Every author, in the order the merge options list them. */
export const AUTHORS: readonly Author[] = ['llm', 'user', 'env', 'tool', 'system', 'initialization'];

/**
 * The experts an MoE inference engine routed each token to (routing replay): row-major [tokens, layers, topK].
 * A token the engine did not route (vLLM returns seq_len − 1 rows: the last token has none) holds −1 in all its
 * slots. Parsed by src/records/routes.ts, the one reader of the record field `routes`.
 */
export interface Routes {
  layers: number;
  topK: number;
  experts: Int16Array;
}

/** A token sequence ready for packing: per-token arrays all as long as `tokens`. */
export interface Sample {
  kind: 'sample';
  id: string;
  group: string;
  episode: string;
  reward?: number;
  advantage?: number; // one value for the whole sample; `advantages` wins when both are given
  tokens: Int32Array;
  loss_mask: Uint8Array; // 0 at t = 0 always
  rollout_logprobs?: Float32Array;
  old_logprobs?: Float32Array;
  ref_logprobs?: Float32Array;
  advantages?: Float32Array;
  /** The engine's routed experts per token (MoE routing replay). */
  routes?: Routes;
  agent?: string;
  /** Start of each message in `tokens` (first 0, increasing): lets the timeline merge see message boundaries. */
  message_offsets?: Int32Array;
  /** Author of each message; default `llm` for a message with trainable tokens, else `env`. */
  message_authors?: Author[];
  /** Where each assistant turn starts in `tokens` (src/pack/turns.ts): set from the timeline's messages. */
  turn_starts?: Int32Array;
  /** Ids of the records absorbed into this sample by the timeline merge (not including its own). */
  merged_from?: string[];
  source: Source;
}

/** A record as read: a chat call or a pre-tokenized sample. */
export type TrainRecord = ChatRecord | Sample;
