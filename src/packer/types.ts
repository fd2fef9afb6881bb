/**
 * The packer's option and report types, apart from the modules that resolve the options (options.ts), describe
 * them (option-table.ts) and fill the report (report.ts): each of those needs another's types, and this module
 * needs none of them, so their imports go one way.
 */
import type { RouteConflictPolicy, RouteStats } from '../pack/routes.js';
import type { BackendName } from '../backend/index.js';
import type { AdvantageEstimator } from '../loss/advantages.js';
import type { MaskSpec } from '../mask/index.js';
import type { ManifestParallelPlan, ManifestSharedPiece } from '../io/sink.js';
import type { CostModel } from '../pack/balance.js';
import type { ReadStats } from '../records/read.js';
import type { MergeOptions } from '../timeline/model.js';
import type { SnapSummary } from '../timeline/snap.js';
import type { SegmentCacheStats } from '../tokenize/chat.js';
import type { TextTokenizer } from '../tokenize/tokenizer.js';

/** The token budget of the packer's micro-batches (`--max-tokens` and the options beside it). */
export interface BudgetSettings {
  /** most packed tokens of a micro-batch, padding included */
  maxTokens: number;
  /** data-parallel ranks: micro-batches per window are a multiple of it, balanced by cost; default 1 */
  dp?: number;
  /** pad each micro-batch's packed length to a multiple of this; default 1 */
  padMultiple?: number;
  /** token id of pad nodes; default 0 */
  padTokenId?: number;
  cost?: CostModel;
  /** see BudgetOptions.balanceSlack; default 0.01 */
  balanceSlack?: number;
  /** prefix reuse (docs/concepts/micro-batching.md, "Step plans"): the most prefix tokens a rank holds cached; off when absent */
  prefixCacheTokens?: number;
  /** bytes one cached prefix token costs, for the manifest's peak_cached_bytes */
  prefixBytesPerToken?: number;
  /** with prefix reuse and dp > 1: compute a prefix held by several ranks once per group, in shares (docs/design.md §11); default true */
  sharedPrefix?: boolean;
  /** with prefix reuse: the most ranks of a context-parallel group the planner may use; default 1 (none) */
  cp?: number;
  /** the planner's cost model: bytes of keys and values of one token over all layers; default 57344 (a 7B model, bf16) */
  kvBytesPerToken?: number;
  /** the planner's cost model: bytes a link moves while a rank computes one token; default 5.7e6 */
  linkBytesPerToken?: number;
}

/** The packer's options: one per row of the option table (docs/reference/cli.md, "Packer options"), plus `name` and `onProgress`. */
export interface PackerOptions {
  /**
   * Tokenizer directory (tokenizer.json + tokenizer_config.json) or a built-in's name (`'qwen3'`), loaded only for
   * chat records; or a tokenizer already loaded (loadTokenizer's result), so a caller that builds a packer per step
   * never loads it again. No default: chat records without one are an E_ARG (pre-tokenized records need none).
   */
  tokenizer?: string | TextTokenizer;
  /** Backend of the forest packer; default the fastest available. */
  backend?: BackendName | 'auto';
  /**
   * Cut the input at the next group boundary once this many naive tokens are gathered: each cut is a window,
   * packed as one micro-batch, or with `budget` split into micro-batches under the token budget. Default 4M.
   */
  windowTokens?: number;
  budget?: BudgetSettings;
  /** Timeline merge policy; false packs every record as its own sample (drift repair of responses still applies). */
  merge?: MergeOptions | false;
  /** Estimator for samples that have rewards but no advantages (per group, one value per episode); default grpo, as `treepack pack`. */
  advantages?: AdvantageEstimator | 'none';
  /** Reject token ids >= vocabSize in pre-tokenized input and in responses' engine token ids. */
  vocabSize?: number;
  /** Attention-mask lowerings added to every micro-batch, as specs or as `--masks` spells them ('block:128,slices'). */
  masks?: readonly MaskSpec[] | string;
  maskBackend?: BackendName | 'auto';
  /** Name of the input in errors, default ids, the report and the manifest (a path names itself). */
  name?: string;
  /** Episode lines sharing an episode_id are parts of one episode; default: an error naming both lines (`--repeated-episode-ids`). */
  repeatedEpisodeIds?: boolean;
  /** Read invalid UTF-8 in JSONL as U+FFFD; default: an error naming line and byte offset (`--lossy-utf8`). */
  lossyUtf8?: boolean;
  /** Store `turn_ids` [M] (docs/reference/format.md) for turn-level losses; default off (`--turn-ids`). */
  turnIds?: boolean;
  /**
   * Where samples' MoE routes of a shared prefix differ: `split` the forest there (exact replay, the default) or keep
   * the `first` sequence's routes (counted in the report); see src/pack/routes.ts (`--route-conflict`).
   */
  routeConflict?: RouteConflictPolicy;
  /** Called as samples enter a window, with the report so far. */
  onProgress?: (report: PackReport) => void;
}

export interface ResolvedOptions {
  tokenizer?: string | TextTokenizer;
  backend: BackendName | 'auto';
  windowTokens: number;
  budget?: BudgetSettings & Required<Pick<BudgetSettings, 'dp' | 'padMultiple' | 'padTokenId' | 'cost' | 'balanceSlack'>>;
  merge: MergeOptions | false;
  advantages: AdvantageEstimator | 'none';
  vocabSize?: number;
  masks: MaskSpec[];
  maskBackend: BackendName | 'auto';
  onProgress?: (report: PackReport) => void;
  repeatedEpisodeIds: boolean;
  lossyUtf8: boolean;
  turnIds: boolean;
  routeConflict: RouteConflictPolicy;
}

/** The counters of a packing run: what `treepack stats --json` and the manifest's header show. */
export interface PackReport {
  /** the input's name: its path, `-` for stdin, else the `name` option or `<stream>` */
  input: string;
  read: ReadStats; // input lines parsed and records they held (an episode line holds one per request)
  samples: number; // after merging
  chatSamples: number;
  timelines: number; // records that entered the merge: timelines = samples + absorbed
  timelineTokens: number; // naive tokens before merging
  absorbed: number;
  apart: number;
  driftedMessages: number;
  snaps: SnapSummary;
  naiveTokens: number; // after merging: what is packed
  packedTokens: number;
  microBatches: number;
  /** Σ over windows of the window's single-forest size (without a budget: the packed tokens) */
  optimumTokens: number;
  /** with a budget: the summed cost per rank */
  rankCosts: number[];
  /** with prefix reuse: tokens computed with grad and pushed without it (summed over windows), the most cached at once */
  prefixReuse?: { computedTokens: number; pushedTokens: number; peakCachedTokens: number; peakCachedBytes?: number; sharedTokens?: number };
  /** with prefix reuse: the shared prefix pieces of every window (manifest `shared_prefixes`) */
  sharedPrefixes?: ManifestSharedPiece[];
  /** with prefix reuse: the parallel planner's choice per window (manifest `parallel_plans`) */
  parallelPlans?: ManifestParallelPlan[];
  /**
   * with MoE routes: the policy, the occurrences whose route differed from their node's first (token-only forest),
   * and the micro-batches' packed tokens without padding as packed (`splitTokens`) and sharing by tokens alone
   * (`unsplitTokens`): what splitting costs is their difference
   */
  routes?: { policy: RouteConflictPolicy } & RouteStats;
  seconds: { readParse: number; tokenize: number; merge: number; pack: number };
  tokenizer: string;
  backend: string; // the forest packer: what ran and why
  tokenizerCache?: SegmentCacheStats;
  /** with mask lowerings: their specs and, per lowering, which backend built the last micro-batch's */
  masks?: MaskSpec[];
  maskBackend?: string[];
  budget?: ResolvedOptions['budget'];
}
