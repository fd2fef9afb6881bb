/**
 * The packer's options as a library caller gives them (and the CLI builds them from its flags), and their
 * resolution: every option with a flag is checked and defaulted from its entry in option-table.ts, so a bad option
 * is E_ARG naming the option before any input is read.
 */
import type { BackendName } from '../backend/index.js';
import { argError } from '../errors.js';
import type { AdvantageEstimator } from '../loss/advantages.js';
import type { MaskSpec } from '../mask/index.js';
import type { CostModel } from '../pack/balance.js';
import type { MergeOptions } from '../timeline/model.js';
import type { TextTokenizer } from '../tokenize/tokenizer.js';
import { copyRecords, getPath, groupOf, isRecord, OPTION_TABLE, setPath, type OptionEntry } from './option-table.js';
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
  /** prefix reuse (docs/concepts/micro-batching.md, "Step plans"): the most prefix tokens a rank holds cached; off when absent */
  prefixCacheTokens?: number;
  /** bytes one cached prefix token costs, for the manifest's peak_cached_bytes */
  prefixBytesPerToken?: number;
}

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
  /** Called as samples enter a window, with the report so far. */
  onProgress?: (report: PackReport) => void;
}

export { DEFAULT_WINDOW_TOKENS } from './option-table.js';

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
}

export function resolveOptions(o: PackerOptions = {}): ResolvedOptions {
  if (o === null || typeof o !== 'object') throw argError('options', 'an object', o);
  // Each value passed its entry's check (or is its default), so the table's result has the declared types.
  return { ...(resolveTable(o as Record<string, unknown>) as unknown as ResolvedOptions), onProgress: o.onProgress };
}

/** The table's options of `o`, checked (E_ARG naming the option) and completed with their defaults. */
function resolveTable(o: Record<string, unknown>): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const e of OPTION_TABLE) {
    const group = groupOf(e);
    if (group !== undefined) {
      if (!(group in out)) {
        // A group without an entry of its own (budget) is off unless given, and then an object.
        const given = o[group];
        if (given === undefined) continue;
        if (!isRecord(given)) throw argError(group, 'an object', given);
        out[group] = copyRecords(given); // the caller's other keys stay, as given
      }
      if (out[group] === false) continue; // turned off (merge: false): its options have nothing to set
      const parent = e.option.slice(0, e.option.lastIndexOf('.'));
      const level = getPath(o, parent); // budget.cost of budget.cost.a
      if (level !== undefined && !isRecord(level)) throw argError(parent, 'an object', level);
    }
    let v = getPath(o, e.option);
    if (v === undefined) {
      if (e.required) throw argError(e.option, e.value.expected, v);
      v = e.default;
      if (v === undefined) continue;
    } else if (!e.value.test(v)) {
      throw argError(e.option, e.value.expected, v);
    }
    // A group's object (merge) is copied, as its options are set into it; any other value is the caller's own.
    setPath(out, e.option, e.value.resolve ? e.value.resolve(v, e.option) : isGroup(e) ? copyRecords(v) : v);
  }
  return out;
}

const isGroup = (e: OptionEntry): boolean => OPTION_TABLE.some((x) => x.option.startsWith(`${e.option}.`));
