/**
 * The packer's options, as a library caller gives them and as the CLI builds them from its flags, and the one
 * place that checks them: a bad option is E_ARG naming the option before any input is read.
 */
import { BACKEND_NAMES, type BackendName } from '../backend/index.js';
import { argError } from '../errors.js';
import { ADVANTAGE_ESTIMATORS, type AdvantageEstimator } from '../loss/advantages.js';
import { parseMaskSpecs } from '../io/masks.js';
import type { MaskSpec } from '../mask/index.js';
import { checkCostModel, DEFAULT_COST, type CostModel } from '../pack/balance.js';
import { mergeDefaults, type MergeOptions } from '../timeline/model.js';
import { isTextTokenizer, type TextTokenizer } from '../tokenize/tokenizer.js';
import type { PackReport } from './report.js';

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
}

export interface PackerOptions {
  /**
   * Tokenizer directory (tokenizer.json + tokenizer_config.json), loaded only for chat records; or a tokenizer
   * already loaded (loadTokenizer's result), so a caller that builds a packer per step never loads it again.
   * Default Qwen3.
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
  /** Called as samples enter a window, with the report so far. */
  onProgress?: (report: PackReport) => void;
}

export const DEFAULT_WINDOW_TOKENS = 4 * 1024 * 1024;

export interface ResolvedOptions {
  tokenizer?: string | TextTokenizer;
  backend: BackendName | 'auto';
  windowTokens: number;
  budget?: BudgetSettings & Required<Pick<BudgetSettings, 'dp' | 'padMultiple' | 'padTokenId' | 'cost'>>;
  merge: MergeOptions | false;
  advantages: AdvantageEstimator | 'none';
  vocabSize?: number;
  masks: MaskSpec[];
  maskBackend: BackendName | 'auto';
  onProgress?: (report: PackReport) => void;
  repeatedEpisodeIds: boolean;
  lossyUtf8: boolean;
}

const isInt = (v: unknown, min: number): v is number => typeof v === 'number' && Number.isSafeInteger(v) && v >= min;

function backendName(name: string, v: unknown): BackendName | 'auto' {
  if (v === undefined || v === 'auto') return 'auto';
  if (!(BACKEND_NAMES as readonly unknown[]).includes(v)) throw argError(name, `one of auto, ${BACKEND_NAMES.join(', ')}`, v);
  return v as BackendName;
}

export function resolveOptions(o: PackerOptions = {}): ResolvedOptions {
  if (o === null || typeof o !== 'object') throw argError('options', 'an object', o);
  if (o.windowTokens !== undefined && !isInt(o.windowTokens, 1)) throw argError('windowTokens', 'an integer >= 1', o.windowTokens);
  if (o.vocabSize !== undefined && !isInt(o.vocabSize, 1)) throw argError('vocabSize', 'an integer >= 1', o.vocabSize);
  if (o.tokenizer !== undefined && typeof o.tokenizer !== 'string' && !isTextTokenizer(o.tokenizer)) {
    throw argError('tokenizer', 'a directory path or a tokenizer from loadTokenizer', o.tokenizer);
  }
  const advantages = o.advantages ?? 'grpo';
  if (advantages !== 'none' && !(ADVANTAGE_ESTIMATORS as readonly string[]).includes(advantages)) {
    throw argError('advantages', `one of ${ADVANTAGE_ESTIMATORS.join(', ')}, none`, advantages);
  }
  if (o.merge !== undefined && o.merge !== false) mergeDefaults(o.merge);
  const masks = typeof o.masks === 'string' ? parseMaskSpecs(o.masks) : [...(o.masks ?? [])];
  return {
    tokenizer: o.tokenizer,
    backend: backendName('backend', o.backend),
    windowTokens: o.windowTokens ?? DEFAULT_WINDOW_TOKENS,
    budget: o.budget === undefined ? undefined : resolveBudget(o.budget),
    merge: o.merge ?? {},
    advantages,
    vocabSize: o.vocabSize,
    masks,
    maskBackend: backendName('maskBackend', o.maskBackend),
    onProgress: o.onProgress,
    repeatedEpisodeIds: o.repeatedEpisodeIds === true,
    lossyUtf8: o.lossyUtf8 === true,
  };
}

function resolveBudget(b: BudgetSettings): NonNullable<ResolvedOptions['budget']> {
  if (b === null || typeof b !== 'object') throw argError('budget', 'an object with maxTokens', b);
  if (!isInt(b.maxTokens, 1)) throw argError('budget.maxTokens', 'an integer >= 1', b.maxTokens);
  for (const k of ['dp', 'padMultiple'] as const) if (b[k] !== undefined && !isInt(b[k], 1)) throw argError(`budget.${k}`, 'an integer >= 1', b[k]);
  if (b.padTokenId !== undefined && !isInt(b.padTokenId, 0)) throw argError('budget.padTokenId', 'a token id >= 0', b.padTokenId);
  if (b.balanceSlack !== undefined && !(typeof b.balanceSlack === 'number' && Number.isFinite(b.balanceSlack) && b.balanceSlack >= 0)) {
    throw argError('budget.balanceSlack', 'a finite number >= 0', b.balanceSlack);
  }
  const cost = b.cost ?? { ...DEFAULT_COST };
  checkCostModel(cost, 'budget.cost');
  return { ...b, dp: b.dp ?? 1, padMultiple: b.padMultiple ?? 1, padTokenId: b.padTokenId ?? 0, cost };
}
