/**
 * The packed micro-batch contract (docs/design.md §3). These names are read by trainers and outside checks:
 * keep them; extend, never rename.
 */

/** Sequences of a batch in CSR form: sequence i is tokens[offsets[i] .. offsets[i+1]). */
export interface Sequences {
  tokens: Int32Array; // [M]
  offsets: Int32Array; // [S+1], offsets[0] = 0, offsets[S] = M
}

/** The node and unmerge arrays: what the packer computes from token sequences alone. */
export interface Forest {
  input_ids: Int32Array; // [N] token of node p
  position_ids: Int32Array; // [N] depth of p
  parent: Int32Array; // [N] packed position of the previous token, -1 for a root
  subtree_end: Int32Array; // [N] one past the last position of p's subtree
  seq_offsets: Int32Array; // [S+1] CSR offsets into the occurrence arrays
  seq_positions: Int32Array; // [M] packed position of token t of sequence i at seq_offsets[i] + t
}

/** The per-node arrays of the contract, each [N] int32. */
export const NODE_FIELDS = ['input_ids', 'position_ids', 'parent', 'subtree_end'] as const;
/** The optional per-occurrence float arrays of the contract, each [M] float32. */
export const OCCURRENCE_FLOAT_FIELDS = ['advantages', 'old_logprobs', 'ref_logprobs', 'rollout_logprobs'] as const;
/** One of OCCURRENCE_FLOAT_FIELDS. */
export type OccurrenceFloatField = (typeof OCCURRENCE_FLOAT_FIELDS)[number];
/** Occurrence arrays a micro-batch may lack: the floats, and the turn ids of turn-level aggregation. */
export const OPTIONAL_OCCURRENCE_FIELDS = [...OCCURRENCE_FLOAT_FIELDS, 'turn_ids'] as const;

/** Header metadata of a micro-batch file: every value is a string in safetensors' `__metadata__`. */
export interface MicroBatchMeta {
  format: 'treepack/1';
  num_sequences: number;
  num_tokens_naive: number;
  num_tokens_packed: number;
  tokenizer: string;
  sequence_ids: string[]; // input order
  /**
   * Extension (micro-batching under a token budget): the last num_pad_tokens nodes are padding, each a root
   * with no occurrence, so N - num_pad_tokens is the forest's own size. Absent when the batch was not padded.
   */
  num_pad_tokens?: number;
  /**
   * Extension: one past the largest token id of the tokenizer that made the ids (or of the caller's vocabSize), so
   * a trainer can refuse a model of another vocabulary. Absent when unknown (pre-tokenized input without vocabSize).
   */
  vocab_size?: number;
  /**
   * Extension (step plans with prefix reuse, docs/concepts/micro-batching.md, "Step plans"): nodes [0, prefix_tokens)
   * are a chain (the first sorted sequence's root path) that the rank holds cached from an earlier micro-batch of the step; before this
   * micro-batch the segments ending at the depths `prefix_push` lists are pushed (run without grad, from the stack's
   * depth), after it `prefix_release` segments are popped. All three present together, or none.
   */
  prefix_tokens?: number;
  prefix_push?: number[];
  prefix_release?: number;
  /**
   * Extension (shared prefixes, docs/design.md §11): per `prefix_push` entry, the id of the shared piece (manifest
   * `shared_prefixes`) that segment is, which the rank's data-parallel group computes in shares, or null.
   */
  prefix_shared?: (number | null)[];
  /** Extension (context parallelism, docs/design.md §11): the ranks that run this micro-batch together, ascending. */
  cp_ranks?: number[];
  /** Extension (routing replay): the shape of `routes`, [N, routes_layers, routes_top_k]; present exactly with it. */
  routes_layers?: number;
  routes_top_k?: number;
  /**
   * Extension (images, docs/reference/format.md "Images"): the image processor's settings (JSON: family, patch_size,
   * merge_size, temporal_patch_size, min_pixels, max_pixels, image_token_id, vision_start_token_id, ...) and the
   * identity of each image (sha256 hex of its decoded bytes and those settings), in image order. Present together
   * with the image tensors.
   */
  image_processor?: Record<string, unknown>;
  image_hashes?: string[];
}

/**
 * Extension (images): each distinct image of the micro-batch once, and which nodes it fills. I images, F fills.
 * Present together, only when the micro-batch has images.
 */
export interface ImageTensors {
  image_pixels: Uint8Array; // [B] RGB bytes (row-major H×W×3) of each image, concatenated in image order
  image_sizes: Int32Array; // [I, 2] (height, width)
  image_grid_thw: Int32Array; // [I, 3] the processor's grid in patches
  image_fills: Int32Array; // [F, 4] (image, first node, first placeholder, count)
  mrope_position_ids: Int32Array; // [3, N] temporal, height, width rotary positions per node
}

/** The image tensors: name → [dtype, shape from (I, F, N, B)]. */
export const IMAGE_FIELDS = {
  image_pixels: ['U8', (d: ImageDims) => [d.B]],
  image_sizes: ['I32', (d: ImageDims) => [d.I, 2]],
  image_grid_thw: ['I32', (d: ImageDims) => [d.I, 3]],
  image_fills: ['I32', (d: ImageDims) => [d.F, 4]],
  mrope_position_ids: ['I32', (d: ImageDims) => [3, d.N]],
} as const;
/** The sizes the image tensors' shapes follow: I images, F fills, N nodes, B pixel bytes. */
export interface ImageDims {
  I: number;
  F: number;
  N: number;
  B: number;
}

/** One packed micro-batch: the forest plus per-occurrence training fields, in input order. */
export interface MicroBatch extends Forest, Partial<ImageTensors> {
  loss_mask: Uint8Array; // [M], 0 for t = 0
  advantages?: Float32Array; // [M]
  old_logprobs?: Float32Array; // [M]
  ref_logprobs?: Float32Array; // [M]
  rollout_logprobs?: Float32Array; // [M]
  /**
   * Extension (turn-level aggregation): per occurrence, the turn of its sequence it belongs to: the number of
   * assistant messages of the sequence that start at or before it, minus one (−1 before the first). Never
   * decreasing along a sequence, so a turn is a run of equal ids; absent when no sample had message boundaries.
   */
  turn_ids?: Int32Array; // [M]
  /**
   * Extension (MoE routing replay): per node, the experts the engine routed it to at each MoE layer, row-major
   * [N, routes_layers, routes_top_k]; −1 in every slot of a node no occurrence was routed at (and of padding).
   */
  routes?: Int16Array;
  meta: MicroBatchMeta;
}

/** The format string written to and required in every micro-batch header. */
export const FORMAT = 'treepack/1';

/** Largest packed or naive length a micro-batch may have: positions are int32. */
export const MAX_TOKENS = 0x7fffffff;
