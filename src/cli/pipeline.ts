/**
 * The streaming path shared by `pack` and `stats`: records → timelines → merged samples → micro-batches, one
 * episode and one micro-batch in memory at a time. The merge sees the timelines of one episode at once, so an
 * episode whose records are not contiguous in the input is merged piecewise (each piece correctly, less merged).
 * Stage times are measured here so both commands (and the bench) report the same figures.
 */
import { performance } from 'node:perf_hooks';
import type { Readable } from 'node:stream';
import { resolveKernel, type BackendName } from '../backend/index.js';
import { TreepackError } from '../errors.js';
import { fillAdvantages, needsAdvantage, type AdvantageEstimator } from '../loss/advantages.js';
import { assembleMicroBatch } from '../pack/batch.js';
import type { MicroBatchPlan } from '../pack/budget.js';
import { MAX_TOKENS, type MicroBatch } from '../pack/contract.js';
import { packWindow, type WindowOptions } from '../pack/window.js';
import { checkResponseVocab, readRecords, type ReadStats } from '../records/read.js';
import type { Sample } from '../records/types.js';
import { timelineFromChat, timelineFromSample, timelineToSample } from '../timeline/build.js';
import { byId, mergeTimelines, snapsOnly } from '../timeline/merge.js';
import { mergeDefaults, timelineLength, type MergeOptions, type Timeline } from '../timeline/model.js';
import { addSnaps, emptySnapSummary, type SnapSummary } from '../timeline/snap.js';
import { ChatEncoder, type SegmentCacheStats } from '../tokenize/chat.js';
import { loadTokenizer } from '../tokenize/tokenizer.js';

export interface PipelineOptions {
  /** Tokenizer directory (tokenizer.json + tokenizer_config.json); default Qwen3. */
  tokenizer?: string;
  backend?: BackendName | 'auto';
  /**
   * Cut at group boundaries once this many naive tokens are gathered: each cut is a micro-batch, or with
   * `budget` a window that is split into micro-batches under the token budget.
   */
  maxNaiveTokens?: number;
  budget?: Omit<WindowOptions, 'tokenizer' | 'packForest'>;
  vocabSize?: number;
  /** Timeline merge policy; false packs every record as its own sample (drift repair of responses still applies). */
  merge?: MergeOptions | false;
  /** Estimator for samples that have rewards but no advantages (per group, per episode); 'none' writes none. */
  advantages?: AdvantageEstimator | 'none';
  onProgress?: (p: PipelineStats) => void;
  /** See ReadOptions: episode lines sharing an id are parts of one episode; invalid UTF-8 read as U+FFFD. */
  repeatedEpisodeIds?: boolean;
  lossyUtf8?: boolean;
}

export interface PipelineStats {
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
  /** with a budget: Σ over windows of the window's single-forest size, and the summed cost per rank */
  optimumTokens: number;
  rankCosts: number[];
  seconds: { readParse: number; tokenize: number; merge: number; pack: number };
  tokenizer: string;
  backend: string; // the packer's report: what ran and why
  tokenizerCache?: SegmentCacheStats;
}

export const DEFAULT_MAX_NAIVE_TOKENS = 4 * 1024 * 1024;

export interface Packed {
  batch: MicroBatch;
  samples: Sample[];
  /** with a budget: rank, step (within the window), cost */
  plan?: MicroBatchPlan;
}

export async function* packStream(input: string | Readable, opts: PipelineOptions, stats: PipelineStats): AsyncGenerator<Packed> {
  const budget = opts.maxNaiveTokens ?? DEFAULT_MAX_NAIVE_TOKENS;
  const packer = await resolveKernel('packForest', opts.backend);
  stats.backend = packer.report;
  let encoder: ChatEncoder | undefined;
  // The tokenizer is loaded only when a chat record needs it: pre-tokenized inputs never pay for it.
  const tokenizerName = () => encoder?.tokenizer.name ?? opts.tokenizer ?? 'none (pre-tokenized input)';
  stats.tokenizer = tokenizerName();

  let pending: Sample[] = [];
  let pendingTokens = 0;
  const estimator = opts.advantages ?? 'none';
  const flushedGroups = new Set<string>();
  const flush = (): Packed[] => {
    if (estimator !== 'none') {
      // Only groups whose advantages are estimated here need to be whole; samples without rewards may repeat a group.
      const estimated = pending.filter(needsAdvantage);
      for (const s of estimated) {
        if (flushedGroups.has(s.group)) {
          throw new TreepackError('E_INPUT', `group ${JSON.stringify(s.group)} appears again after its micro-batch was written: advantages need a group's records to be contiguous in the input`, {
            file: s.source.file,
            line: s.source.line,
            record: s.id,
            field: 'group',
          });
        }
      }
      fillAdvantages(pending, { estimator });
      for (const s of estimated) flushedGroups.add(s.group);
    }
    const t0 = performance.now();
    let out: Packed[];
    if (opts.budget) {
      const w = packWindow(pending, { ...opts.budget, tokenizer: tokenizerName(), packForest: packer.kernel });
      out = w.microBatches.map((mb) => ({ batch: mb.batch, samples: mb.samples, plan: mb.plan }));
      stats.optimumTokens += w.plan.optimumTokens;
      w.plan.rankCosts.forEach((c, r) => (stats.rankCosts[r] = (stats.rankCosts[r] ?? 0) + c));
    } else {
      out = [{ batch: assembleMicroBatch(pending, { tokenizer: tokenizerName(), packForest: packer.kernel }), samples: pending }];
      stats.optimumTokens += out[0].batch.meta.num_tokens_packed;
    }
    stats.seconds.pack += (performance.now() - t0) / 1000;
    for (const p of out) stats.packedTokens += p.batch.meta.num_tokens_packed;
    stats.microBatches += out.length;
    pending = [];
    pendingTokens = 0;
    return out;
  };

  const addSample = function* (sample: Sample): Generator<Packed> {
    const prev = pending[pending.length - 1];
    // Groups share their prompts, and advantages need whole groups: a group is split (at an episode boundary) only
    // when no estimator runs and it alone outgrows the budget several times.
    const splitGroup = estimator === 'none' && prev?.episode !== sample.episode && pendingTokens >= 4 * budget;
    if (prev && ((prev.group !== sample.group && pendingTokens >= budget) || splitGroup)) {
      yield* flush();
    }
    if (pendingTokens + sample.tokens.length > MAX_TOKENS) {
      throw new TreepackError('E_LIMIT', `one episode exceeds ${MAX_TOKENS} naive tokens; a micro-batch indexes tokens with int32`, {
        file: sample.source.file,
        line: sample.source.line,
        record: sample.id,
      });
    }
    pending.push(sample);
    pendingTokens += sample.tokens.length;
    stats.samples++;
    stats.naiveTokens += sample.tokens.length;
    opts.onProgress?.(stats);
  };

  const policy = mergeDefaults(opts.merge || {});
  const merging = opts.merge !== false;
  let episode: (Timeline | Sample)[] = [];
  const flushEpisode = function* (): Generator<Packed> {
    const items = episode;
    episode = [];
    const t0 = performance.now();
    let samples: Sample[];
    if (merging) {
      const timelines = items.filter((x): x is Timeline => !('kind' in x));
      const { samples: merged, report } = mergeTimelines(timelines, policy);
      samples = merged.concat(items.filter((x): x is Sample => 'kind' in x)).sort((a, b) => byId(a.id, b.id));
      stats.absorbed += report.absorbed;
      stats.apart += report.apart;
      stats.driftedMessages += report.driftedMessages;
      addSnaps(stats.snaps, report.snaps);
    } else {
      samples = items.map((x) => ('kind' in x ? x : timelineToSample(x)));
      if (policy.detectTimelineSnap) addSnaps(stats.snaps, snapsOnly(items.filter((x): x is Timeline => !('kind' in x)), policy));
    }
    stats.seconds.merge += (performance.now() - t0) / 1000;
    for (const s of samples) yield* addSample(s);
  };

  const records = readRecords(input, { vocabSize: opts.vocabSize, stats: stats.read, repeatedEpisodeIds: opts.repeatedEpisodeIds, lossyUtf8: opts.lossyUtf8 });
  for (;;) {
    let t0 = performance.now();
    const next = await records.next();
    stats.seconds.readParse += (performance.now() - t0) / 1000;
    if (next.done) break;
    const rec = next.value;
    let item: Timeline | Sample;
    if (rec.kind === 'chat') {
      t0 = performance.now();
      encoder ??= new ChatEncoder(await loadTokenizer(opts.tokenizer));
      checkResponseVocab(rec, opts.vocabSize ?? encoder.tokenizer.vocabSize);
      const built = timelineFromChat(rec, encoder, policy);
      if (built.drifted) stats.driftedMessages++;
      item = built.timeline;
      stats.seconds.tokenize += (performance.now() - t0) / 1000;
      stats.chatSamples++;
      stats.tokenizer = tokenizerName();
      stats.tokenizerCache = encoder.stats;
    } else {
      item = timelineFromSample(rec) ?? rec;
    }
    stats.timelines++;
    stats.timelineTokens += 'kind' in item ? item.tokens.length : timelineLength(item);
    if (episode.length > 0 && episode[0]!.episode !== rec.episode) yield* flushEpisode();
    episode.push(item);
  }
  if (episode.length) yield* flushEpisode();
  if (pending.length) yield* flush();
}

export function emptyStats(): PipelineStats {
  return {
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
