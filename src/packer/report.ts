/**
 * What a packing run reports: the counters behind `treepack stats --json` and the header of manifest.json,
 * updated as the run goes (a progress display reads it live).
 */
import { imbalance } from '../pack/balance.js';
import type { ReadStats } from '../records/read.js';
import type { SnapSummary } from '../timeline/snap.js';
import { emptySnapSummary } from '../timeline/snap.js';
import type { SegmentCacheStats } from '../tokenize/chat.js';
import { MANIFEST_FORMAT, type ManifestHeader } from '../io/sink.js';
import type { MaskSpec } from '../mask/index.js';
import { getPath, OPTION_TABLE, setPath, type OptionEntry } from './option-table.js';
import type { ResolvedOptions } from './options.js';

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
  prefixReuse?: { computedTokens: number; pushedTokens: number; peakCachedTokens: number; peakCachedBytes?: number };
  seconds: { readParse: number; tokenize: number; merge: number; pack: number };
  tokenizer: string;
  backend: string; // the forest packer: what ran and why
  tokenizerCache?: SegmentCacheStats;
  /** with mask lowerings: their specs and, per lowering, which backend built the last micro-batch's */
  masks?: MaskSpec[];
  maskBackend?: string[];
  budget?: ResolvedOptions['budget'];
}

export function emptyReport(input: string): PackReport {
  return {
    input,
    read: { lines: 0, records: 0 },
    samples: 0,
    chatSamples: 0,
    timelines: 0,
    timelineTokens: 0,
    absorbed: 0,
    apart: 0,
    driftedMessages: 0,
    snaps: emptySnapSummary(),
    naiveTokens: 0,
    packedTokens: 0,
    microBatches: 0,
    optimumTokens: 0,
    rankCosts: [],
    seconds: { readParse: 0, tokenize: 0, merge: 0, pack: 0 },
    tokenizer: '',
    backend: '',
  };
}

/** The options the manifest shows by value, by their top-level name: `budget`, `masks`. */
const REPORTED = [...new Set(OPTION_TABLE.filter((e) => e.manifest && !e.manifest.ran).map((e) => e.option.split('.')[0]))];

/** Puts the resolved options the manifest shows into the report, under their own names; an empty list is none. */
export function reportOptions(report: PackReport, opts: ResolvedOptions): void {
  for (const name of REPORTED) {
    const v = (opts as unknown as Record<string, unknown>)[name];
    if (v !== undefined && !(Array.isArray(v) && v.length === 0)) (report as unknown as Record<string, unknown>)[name] = v;
  }
}

const inBudget = (e: OptionEntry): boolean => e.option.startsWith('budget.');

/** manifest.json without its micro-batch list, keys in the order they are written. */
export function manifestHeader(r: PackReport): ManifestHeader {
  const header = {
    format: MANIFEST_FORMAT,
    input: r.input,
    ...optionFields(r, (e) => !inBudget(e)),
    records: r.read.lines,
    timelines: r.timelines,
    absorbed: r.absorbed,
    sequences: r.samples,
    naive_tokens: r.naiveTokens,
    packed_tokens: r.packedTokens,
    ...(r.budget && { ...optionFields(r, inBudget), optimum_tokens: r.optimumTokens, rank_costs: r.rankCosts, imbalance: imbalance(r.rankCosts) }),
    ...(r.prefixReuse && {
      computed_tokens: r.prefixReuse.computedTokens,
      pushed_tokens: r.prefixReuse.pushedTokens,
      peak_cached_tokens: r.prefixReuse.peakCachedTokens,
      ...(r.prefixReuse.peakCachedBytes !== undefined && { peak_cached_bytes: r.prefixReuse.peakCachedBytes }),
    }),
  };
  // The option fields come from the table, typed there as unknown; ManifestHeader names each one it writes.
  return header as unknown as ManifestHeader;
}

/** The manifest fields of the options `which` picks, in the table's order (see OptionEntry.manifest). */
function optionFields(r: PackReport, which: (e: OptionEntry) => boolean): Record<string, unknown> {
  const fields: Record<string, unknown> = {};
  for (const e of OPTION_TABLE) {
    if (!e.manifest || !which(e)) continue;
    const v = getPath(r, e.option);
    const shown = v !== undefined && e.manifest.show ? e.manifest.show(v as never) : v;
    if (shown !== undefined) setPath(fields, e.manifest.key, shown);
  }
  return fields;
}
