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
import type { ResolvedOptions } from './options.js';

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

/** `--masks` spelling of a lowering, as the manifest lists it. */
const maskName = (m: MaskSpec): string => (m.kind === 'blocks' ? `block:${m.blockSize}` : m.kind);

/** manifest.json without its micro-batch list, keys in the order they are written. */
export function manifestHeader(r: PackReport): ManifestHeader {
  const b = r.budget;
  return {
    format: MANIFEST_FORMAT,
    input: r.input,
    tokenizer: r.tokenizer,
    backend: r.backend,
    ...(r.masks?.length ? { masks: r.masks.map(maskName), mask_backend: r.maskBackend ?? [] } : {}),
    records: r.read.lines,
    timelines: r.timelines,
    absorbed: r.absorbed,
    sequences: r.samples,
    naive_tokens: r.naiveTokens,
    packed_tokens: r.packedTokens,
    ...(b && {
      max_tokens: b.maxTokens,
      dp: b.dp,
      pad_multiple: b.padMultiple,
      cost_model: b.cost,
      optimum_tokens: r.optimumTokens,
      rank_costs: r.rankCosts,
      imbalance: imbalance(r.rankCosts),
    }),
  };
}
