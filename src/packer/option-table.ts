/**
 * The packer's options, one plain object each: where the option sits in `PackerOptions`, its `treepack pack`
 * flag, the values it takes, its default, its --help text and how manifest.json shows it. The library's checks
 * and defaults (options.ts), the flags of `pack`, `stats` and `serve` with their parsing and --help (cli/args.ts),
 * and the option fields of the report and the manifest (report.ts) are all read from here: an option is added by
 * adding its entry (CONTRIBUTING.md, "Adding a packer option").
 */
import { BACKEND_NAMES } from '../backend/index.js';
import { MASKS_OPTION_HELP, parseMaskSpecs } from '../io/masks.js';
import { ADVANTAGE_ESTIMATORS } from '../loss/advantages.js';
import type { MaskSpec } from '../mask/index.js';
import { DEFAULT_COST } from '../pack/balance.js';
import { DEFAULT_BALANCE_SLACK } from '../pack/budget.js';
import { DEFAULT_KV_BYTES_PER_TOKEN, DEFAULT_LINK_BYTES_PER_TOKEN } from '../pack/planner.js';
import { ROUTE_CONFLICT_POLICIES } from '../pack/routes.js';
import { isTextTokenizer } from '../tokenize/tokenizer.js';
import type { PackerOptions } from './types.js';

/** What values an option takes: one test for the library's values and the flag's, and how a flag's text reads. */
export interface ValueKind {
  /** the valid values in words, as errors say them: "Expected <expected> for <name> but received …" */
  expected: string;
  test(v: unknown): boolean;
  /** the library value a flag's text spells (a switch has no text) */
  parse?(text: string): unknown;
  /** the form the packer works with, of a value that passed `test`; rejects, naming `name`, what `test` cannot tell */
  resolve?(v: unknown, name: string): unknown;
}

/** Naive tokens gathered before the packer starts a new window at the next group (`--max-naive-tokens`). */
export const DEFAULT_WINDOW_TOKENS = 4 * 1024 * 1024;

export const isRecord = (v: unknown): v is Record<string, unknown> => typeof v === 'object' && v !== null && !Array.isArray(v);
// Number('') is 0: a flag given an empty value must not read as zero.
const numberText = (text: string): number => (text.trim() === '' ? NaN : Number(text));
const asText = (text: string): string => text;

export const int = (min: number): ValueKind => ({
  expected: `an integer >= ${min}`,
  test: (v) => typeof v === 'number' && Number.isSafeInteger(v) && v >= min,
  parse: numberText,
});
const nonNegative: ValueKind = {
  expected: 'a finite number >= 0',
  test: (v) => typeof v === 'number' && Number.isFinite(v) && v >= 0,
  parse: numberText,
};
const oneOf = (values: readonly string[]): ValueKind => ({
  expected: `one of ${values.join(', ')}`,
  test: (v) => values.includes(v as string),
  parse: asText,
});
export const backendKind = oneOf(['auto', ...BACKEND_NAMES]);
const bool: ValueKind = { expected: 'true or false', test: (v) => typeof v === 'boolean' };

/** Option paths of T: 'budget' and 'budget.dp'; lists, strings and functions are leaves. */
type Group<V> = Exclude<V, undefined | null | boolean | number | string | readonly unknown[] | ((...args: never[]) => unknown)>;
type Paths<T> = { [K in keyof T & string]-?: K | ([Group<T[K]>] extends [never] ? never : `${K}.${Paths<Group<T[K]>>}`) }[keyof T & string];

export interface OptionEntry {
  /** where the option sits in PackerOptions: 'budget.dp' is `options.budget.dp` */
  option: Paths<PackerOptions>;
  /** the flag of `treepack pack` (and of `stats` and `serve` where they take it) */
  flag: `--${string}`;
  /** the flag's value as --help names it; absent: a switch, which sets the option to `sets` */
  metavar?: string;
  sets?: unknown;
  value: ValueKind;
  /** the value when the option is left out; undefined: none (the option is off) */
  default?: unknown;
  /** needed by its group: a budget is given with its maxTokens (`--dp` needs `--max-tokens`) */
  required?: true;
  help: string;
  /** it shapes only the written micro-batches: `stats`, which writes none, does not take it */
  output?: true;
  /**
   * How manifest.json shows it: under `key` (a path), from the report's field at the option's path, spelled by
   * `show` (undefined: left out). `ran`: that report field says what ran (a backend and why, the tokenizer's
   * name), not the value asked for. A budget option is written beside the budget's figures, the others after
   * `input`. An option the manifest shows is also a field of the report (the budget and masks as resolved).
   */
  manifest?: { key: string; show?: (v: never) => unknown; ran?: true };
}

/**
 * Every option with a flag, in the order of `pack --help`; a group's own entry (`merge`) comes before its options.
 * `name` and `onProgress` exist only in the library.
 */
export const OPTION_TABLE: readonly OptionEntry[] = [
  {
    option: 'tokenizer',
    flag: '--tokenizer',
    metavar: 'DIR|NAME',
    // The library also takes the tokenizer loadTokenizer returned (a caller building a packer per step loads it once).
    value: {
      expected: 'a directory path, the name of a built-in (qwen3) or a tokenizer from loadTokenizer',
      test: (v) => (typeof v === 'string' && v !== '') || isTextTokenizer(v),
      parse: asText,
    },
    help: 'tokenizer.json + tokenizer_config.json, or a built-in by name (qwen3); required for chat records',
    manifest: { key: 'tokenizer', ran: true },
  },
  {
    option: 'backend',
    flag: '--backend',
    metavar: 'NAME',
    value: backendKind,
    default: 'auto',
    help: 'packer backend: auto, cpu, js',
    manifest: { key: 'backend', ran: true },
  },
  {
    option: 'windowTokens',
    flag: '--max-naive-tokens',
    metavar: 'T',
    value: int(1),
    default: DEFAULT_WINDOW_TOKENS,
    help: 'start a new micro-batch at the next group once T naive tokens are gathered',
  },
  {
    option: 'vocabSize',
    flag: '--vocab-size',
    metavar: 'V',
    value: int(1),
    help: "reject token ids >= V in pre-tokenized input and in responses' engine token ids",
  },
  {
    option: 'budget.maxTokens',
    flag: '--max-tokens',
    metavar: 'T',
    value: int(1),
    required: true,
    output: true,
    help: 'split each cut into micro-batches of at most T packed tokens (padding included), keeping shared prefixes together; a cut is then a window of groups',
    manifest: { key: 'max_tokens' },
  },
  {
    option: 'budget.dp',
    flag: '--dp',
    metavar: 'K',
    value: int(1),
    default: 1,
    output: true,
    help: 'data-parallel ranks: micro-batches per window are a multiple of K, balanced by cost over the ranks (manifest: rank, step)',
    manifest: { key: 'dp' },
  },
  {
    option: 'budget.padMultiple',
    flag: '--pad-multiple',
    metavar: 'P',
    value: int(1),
    default: 1,
    output: true,
    help: "pad each micro-batch's packed length to a multiple of P",
    manifest: { key: 'pad_multiple' },
  },
  { option: 'budget.padTokenId', flag: '--pad-id', metavar: 'ID', value: int(0), default: 0, output: true, help: 'token id of pad nodes' },
  {
    option: 'budget.cost.a',
    flag: '--cost-token',
    metavar: 'A',
    value: nonNegative,
    default: DEFAULT_COST.a,
    output: true,
    help: 'cost per packed token',
    manifest: { key: 'cost_model.a' },
  },
  {
    option: 'budget.cost.b',
    flag: '--cost-pair',
    metavar: 'B',
    value: nonNegative,
    default: DEFAULT_COST.b,
    output: true,
    help: 'cost per attention pair under the tree mask',
    manifest: { key: 'cost_model.b' },
  },
  {
    option: 'budget.balanceSlack',
    flag: '--balance-slack',
    metavar: 'F',
    value: nonNegative,
    default: DEFAULT_BALANCE_SLACK,
    output: true,
    help: 'with --dp > 1, subtrees move between ranks to lower the slowest one, adding at most this fraction of packed tokens (0: none; where T >= 4x the longest sequence, never past 5% of the optimum if that is reachable)',
  },
  {
    option: 'budget.prefixCacheTokens',
    flag: '--prefix-reuse',
    metavar: 'C',
    value: int(0),
    output: true,
    help: 'step plans with prefix reuse: a micro-batch may hang from a prefix an earlier one of its rank cached (at most C tokens cached per rank); T then bounds the tokens each computes (manifest: prefix_tokens, prefix_push, prefix_release)',
    manifest: { key: 'prefix_cache_tokens' },
  },
  {
    option: 'budget.prefixBytesPerToken',
    flag: '--prefix-bytes-per-token',
    metavar: 'BYTES',
    value: nonNegative,
    output: true,
    help: "with --prefix-reuse: bytes one cached token costs (keys, values and their gradients over all layers), for the manifest's peak_cached_bytes",
    manifest: { key: 'prefix_bytes_per_token' },
  },
  {
    option: 'budget.sharedPrefix',
    flag: '--no-shared-prefix',
    sets: false,
    value: bool,
    default: true,
    output: true,
    help: 'with --prefix-reuse and --dp > 1: let every rank compute the prefixes its micro-batches hang from (default: a prefix held by several ranks is computed once per group, in shares; manifest: shared_prefixes, prefix_shared)',
    manifest: { key: 'shared_prefix' },
  },
  {
    option: 'budget.cp',
    flag: '--cp',
    metavar: 'G',
    value: int(1),
    default: 1,
    output: true,
    help: 'with --prefix-reuse: the planner may run a step over context-parallel groups of up to G ranks (G divides --dp): each rank computes 1/G of micro-batches of G×T tokens and caches 1/G of G×C (manifest: parallel_plans, cp_ranks)',
    manifest: { key: 'cp' },
  },
  {
    option: 'budget.kvBytesPerToken',
    flag: '--kv-bytes-per-token',
    metavar: 'BYTES',
    value: nonNegative,
    default: DEFAULT_KV_BYTES_PER_TOKEN,
    output: true,
    help: "the planner's cost model: bytes of keys and values of one token over all layers (default: a 7B model in bf16, 28 layers x 2 x 4 heads x 128 x 2)",
    manifest: { key: 'kv_bytes_per_token' },
  },
  {
    option: 'budget.linkBytesPerToken',
    flag: '--link-bytes-per-token',
    metavar: 'BYTES',
    value: nonNegative,
    default: DEFAULT_LINK_BYTES_PER_TOKEN,
    output: true,
    help: "the planner's cost model: bytes a rank's link moves while it computes one token, forward and backward (default: 50 GB/s against 114 us per 7B token)",
    manifest: { key: 'link_bytes_per_token' },
  },
  {
    option: 'merge',
    flag: '--no-merge',
    sets: false,
    value: { expected: 'false or a MergeOptions object', test: (v) => v === false || isRecord(v) },
    default: {},
    help: 'pack every record as its own sample (no timeline merge)',
  },
  {
    option: 'merge.timelineCompareLevel',
    flag: '--timeline-compare-level',
    metavar: 'L',
    value: oneOf(['text', 'token']),
    default: 'text',
    help: 'timeline merge compares messages by text or token',
  },
  {
    option: 'repeatedEpisodeIds',
    flag: '--repeated-episode-ids',
    sets: true,
    value: bool,
    default: false,
    help: 'episode lines sharing an episode_id are parts of one episode (default: an error naming both lines, unless the lines are identical)',
  },
  {
    option: 'lossyUtf8',
    flag: '--lossy-utf8',
    sets: true,
    value: bool,
    default: false,
    help: 'read invalid UTF-8 as U+FFFD (default: an error naming line and byte offset)',
  },
  {
    option: 'advantages',
    flag: '--advantages',
    metavar: 'NAME',
    value: oneOf([...ADVANTAGE_ESTIMATORS, 'none']),
    default: 'grpo',
    output: true,
    help: `estimator for samples with a reward and no advantages: ${[...ADVANTAGE_ESTIMATORS, 'none'].join(', ')} (per group = task id, one value per episode broadcast to all its turns; groups are then never split)`,
  },
  {
    option: 'turnIds',
    flag: '--turn-ids',
    sets: true,
    value: bool,
    default: false,
    output: true,
    help: "store each occurrence's assistant turn (turn_ids [M]) for turn-level losses such as the Flow-GRPO aggregation (default: not stored)",
  },
  {
    option: 'routeConflict',
    flag: '--route-conflict',
    metavar: 'POLICY',
    value: oneOf(ROUTE_CONFLICT_POLICIES),
    default: 'split',
    help: "where samples' MoE routes of a shared prefix differ: split (the forest branches there, so replay is exact) or first (share by tokens, keep the first sequence's routes; counted)",
  },
  {
    option: 'masks',
    flag: '--masks',
    metavar: 'LIST',
    value: {
      expected: 'a list like "block:128,slices" or an array of mask specs',
      test: (v) => typeof v === 'string' || Array.isArray(v),
      parse: asText,
      resolve: (v, name) => (typeof v === 'string' ? parseMaskSpecs(v, name) : [...(v as MaskSpec[])]),
    },
    default: [],
    output: true,
    help: `add attention-mask lowerings to every micro-batch, comma-separated: ${MASKS_OPTION_HELP}; e.g. --masks block:128,slices (tensors named as in docs/reference/format.md; block_size in the metadata)`,
    manifest: { key: 'masks', show: (specs: MaskSpec[]) => (specs.length ? specs.map(maskName) : undefined) },
  },
  {
    option: 'maskBackend',
    flag: '--mask-backend',
    metavar: 'NAME',
    value: backendKind,
    default: 'auto',
    output: true,
    help: `backend for the masks: ${backendKind.expected.replace(/^one of /, '')}`,
    manifest: { key: 'mask_backend', ran: true },
  },
];

/** `--masks` spelling of a lowering, as the manifest lists it. */
const maskName = (m: MaskSpec): string => (m.kind === 'blocks' ? `block:${m.blockSize}` : m.kind);

export function optionEntry(option: OptionEntry['option']): OptionEntry {
  const e = OPTION_TABLE.find((x) => x.option === option);
  if (!e) throw new Error(`no option ${option} in OPTION_TABLE`);
  return e;
}

/** The option's group ('budget' of 'budget.cost.a'), or undefined for a top-level option. */
export const groupOf = (e: OptionEntry): string | undefined => (e.option.includes('.') ? e.option.split('.')[0] : undefined);

/** The value at `path` ('budget.cost.a'); undefined where a level is missing or not an object. */
export function getPath(o: unknown, path: string): unknown {
  let v = o;
  for (const k of path.split('.')) v = isRecord(v) ? v[k] : undefined;
  return v;
}

/** Sets the value at `path`, creating the levels it needs. */
export function setPath(o: Record<string, unknown>, path: string, value: unknown): void {
  const keys = path.split('.');
  let level = o;
  for (const k of keys.slice(0, -1)) level = (level[k] ??= {}) as Record<string, unknown>;
  level[keys[keys.length - 1]] = value;
}

/** A copy of nested plain objects, so resolving options never writes into the caller's. */
export const copyRecords = (v: unknown): unknown =>
  isRecord(v) ? Object.fromEntries(Object.entries(v).map(([k, x]) => [k, copyRecords(x)])) : v;
