/**
 * What a packing run reports: the counters behind `treepack stats --json` and the header of manifest.json,
 * updated as the run goes (a progress display reads it live).
 */
import { imbalance } from '../pack/balance.js';
import { emptySnapSummary } from '../timeline/snap.js';
import { MANIFEST_FORMAT, type ManifestHeader } from '../io/sink.js';
import { getPath, OPTION_TABLE, setPath, type OptionEntry } from './option-table.js';
import type { PackReport, ResolvedOptions } from './types.js';

export type { PackReport } from './types.js';

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
    ...(r.budget && {
      ...optionFields(r, inBudget),
      optimum_tokens: r.optimumTokens,
      rank_costs: r.rankCosts,
      imbalance: imbalance(r.rankCosts),
    }),
    ...(r.prefixReuse && {
      computed_tokens: r.prefixReuse.computedTokens,
      pushed_tokens: r.prefixReuse.pushedTokens,
      peak_cached_tokens: r.prefixReuse.peakCachedTokens,
      ...(r.prefixReuse.peakCachedBytes !== undefined && { peak_cached_bytes: r.prefixReuse.peakCachedBytes }),
      ...(r.prefixReuse.sharedTokens !== undefined && { shared_tokens: r.prefixReuse.sharedTokens }),
    }),
    ...(r.parallelPlans && { parallel_plans: r.parallelPlans }),
    ...(r.sharedPrefixes && { shared_prefixes: r.sharedPrefixes }),
    ...(r.routes && {
      route_conflict: r.routes.policy,
      route_conflicts: r.routes.conflicts,
      route_split_tokens: r.routes.splitTokens,
      route_unsplit_tokens: r.routes.unsplitTokens,
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
