/**
 * The streaming packer: records → timelines → merged samples → advantages → windows → micro-batches (+ mask
 * lowerings and manifest entries), one episode and one window in memory at a time.
 *
 * Records are grouped into episodes by contiguity: the merge sees the timelines of one episode at once, so an
 * episode whose records are not contiguous is merged piecewise (each piece correctly, less merged). A window
 * closes at the first sample of another group once `windowTokens` naive tokens are gathered (or at `endGroup`,
 * which says the next sample is of another group), so groups, which share their prompts and need to be whole for
 * their advantages, stay in one window. Stage times are measured here so the CLI, the bench and a service report
 * the same figures.
 */
import { performance } from 'node:perf_hooks';
import { resolveKernel, type Resolved } from '../backend/index.js';
import { TreepackError } from '../errors.js';
import { microBatchFileName, type ManifestEntry } from '../io/sink.js';
import { fillAdvantages, needsAdvantage } from '../loss/advantages.js';
import { maskTensors, type MaskTensors } from '../io/masks.js';
import { assembleMicroBatch } from '../pack/batch.js';
import type { MicroBatchPlan, Plan } from '../pack/budget.js';
import { MAX_TOKENS, type MicroBatch } from '../pack/contract.js';
import { packWindow } from '../pack/window.js';
import { checkResponseVocab } from '../records/read.js';
import type { Sample, TrainRecord } from '../records/types.js';
import { timelineFromChat, timelineFromSample, timelineToSample } from '../timeline/build.js';
import { byId, mergeTimelines, snapsOnly } from '../timeline/merge.js';
import { mergeDefaults, timelineLength, type ResolvedMergeOptions, type Timeline } from '../timeline/model.js';
import { addSnaps } from '../timeline/snap.js';
import { ChatEncoder, hasImages } from '../tokenize/chat.js';
import { resolveTokenizer, TOKENIZER_HINT } from '../tokenize/tokenizer.js';
import type { ResolvedOptions } from './options.js';
import { reportOptions, type PackReport } from './report.js';

/** One micro-batch of a run: the packed batch, its mask lowerings if asked for, and its manifest entry. */
export interface PackedMicroBatch {
  /** position in the run, from 0: the manifest entry's index */
  index: number;
  batch: MicroBatch;
  samples: Sample[];
  /** with a budget: rank, step within the window, cost, pad tokens, attention pairs */
  plan?: MicroBatchPlan;
  /** the mask lowerings asked for, as file tensors */
  masks?: MaskTensors;
  entry: ManifestEntry;
}

/** A window's micro-batch before its index, masks and manifest entry. */
interface Packed {
  batch: MicroBatch;
  samples: Sample[];
  plan?: MicroBatchPlan;
  /** the global step of its window's first step, and the id of its window's first shared piece */
  stepBase?: number;
  pieceBase?: number;
}

/**
 * The pipeline's state between records. `accept` and `endGroup` only queue work; `take` runs it and yields the
 * micro-batches of every window closed so far, lowering masks one micro-batch at a time.
 */
export class PackerCore {
  readonly report: PackReport;
  readonly #opts: ResolvedOptions;
  readonly #policy: ResolvedMergeOptions;
  #kernel: Resolved<'packForest'> | undefined;
  #encoder: ChatEncoder | undefined;
  #queue: (TrainRecord | { endGroup: true })[] = [];
  #episode: (Timeline | Sample)[] = [];
  #pending: Sample[] = [];
  #pendingTokens = 0;
  #ready: Packed[] = [];
  #flushedGroups = new Set<string>();
  #next = 0;
  #steps = 0; // steps of the windows planned so far
  #pieces = 0; // shared pieces of the windows planned so far

  constructor(opts: ResolvedOptions, report: PackReport) {
    this.#opts = opts;
    this.report = report;
    this.#policy = mergeDefaults(opts.merge || {});
    reportOptions(report, opts);
    if (opts.masks.length) report.maskBackend = [];
    report.tokenizer = this.#tokenizerName();
  }

  /** Resolves the forest packer (before any input is read, so a missing backend is reported first). */
  async init(): Promise<void> {
    if (this.#kernel) return;
    this.#kernel = await resolveKernel('packForest', this.#opts.backend);
    this.report.backend = this.#kernel.report;
  }

  accept(rec: TrainRecord): void {
    this.#queue.push(rec);
  }

  endGroup(): void {
    this.#queue.push({ endGroup: true });
  }

  /** Runs the queued work and yields the micro-batches of closed windows; with `final`, closes the last window. */
  async *take(final: boolean): AsyncGenerator<PackedMicroBatch> {
    await this.init();
    while (this.#queue.length) {
      const item = this.#queue.shift()!;
      if ('endGroup' in item) {
        this.#flushEpisode();
        if (this.#pendingTokens >= this.#opts.windowTokens) this.#flushWindow();
      } else await this.#process(item);
      yield* this.#emit();
    }
    if (final) {
      this.#flushEpisode();
      if (this.#pending.length) this.#flushWindow();
      yield* this.#emit();
    }
  }

  async *#emit(): AsyncGenerator<PackedMicroBatch> {
    while (this.#ready.length) {
      const p = this.#ready.shift()!;
      const index = this.#next++;
      const file = microBatchFileName(index);
      const { masks, maskBackend } = this.#opts;
      const lowered = masks.length
        ? await maskTensors(p.batch, masks, maskBackend).catch((err: unknown) => {
            throw err instanceof TreepackError ? new TreepackError(err.code, err.message, { file }) : err;
          })
        : undefined;
      if (lowered) this.report.maskBackend = lowered.reports;
      const b = p.batch.meta;
      const entry: ManifestEntry = {
        file,
        sequences: b.num_sequences,
        naive_tokens: b.num_tokens_naive,
        packed_tokens: b.num_tokens_packed,
      };
      const budget = this.#opts.budget;
      if (p.plan && budget) {
        Object.assign(entry, {
          rank: p.plan.rank,
          step: p.stepBase! + p.plan.step,
          pad_tokens: p.plan.padTokens,
          attention_pairs: p.plan.attentionPairs,
          cost: p.plan.cost,
        });
        const op = p.plan.prefix;
        if (op)
          Object.assign(entry, {
            prefix_tokens: op.tokens,
            prefix_push: op.push,
            prefix_release: op.release,
            computed_tokens: p.plan.computedTokens,
            pushed_tokens: p.plan.pushedTokens,
            ...(op.shared && { prefix_shared: op.shared.map((id) => (id === null ? null : id + p.pieceBase!)) }),
          });
        if (p.plan.cpRanks) entry.cp_ranks = p.plan.cpRanks;
      }
      yield { index, batch: p.batch, samples: p.samples, ...(p.plan && { plan: p.plan }), ...(lowered && { masks: lowered }), entry };
    }
  }

  // The tokenizer is loaded only when a chat record needs it: pre-tokenized inputs never pay for it. A given one
  // is named either way (a loaded one by its name, which for a directory is the path it was loaded from).
  #tokenizerName(): string {
    const given = this.#opts.tokenizer;
    return this.#encoder?.tokenizer.name ?? (typeof given === 'object' ? given.name : given) ?? 'none (pre-tokenized input)';
  }

  /** What the micro-batch headers say of the ids: the tokenizer's name and, when known, its vocabulary size. */
  #vocabulary(): { tokenizer: string; vocabSize?: number } {
    // A tokenizer counts once it encoded: given as a path or loaded, pre-tokenized input writes the same bytes.
    const vocabSize = this.#opts.vocabSize ?? this.#encoder?.tokenizer.vocabSize;
    return { tokenizer: this.#tokenizerName(), ...(vocabSize !== undefined && { vocabSize }) };
  }

  async #process(rec: TrainRecord): Promise<void> {
    const stats = this.report;
    let item: Timeline | Sample;
    if (rec.kind === 'chat') {
      const t0 = performance.now();
      if (this.#encoder === undefined && this.#opts.tokenizer === undefined) {
        // Token ids of another model's vocabulary would train silently wrong: there is no default tokenizer.
        throw new TreepackError('E_ARG', `chat records need a tokenizer, and none was given: ${TOKENIZER_HINT}`, {
          file: rec.source.file,
          line: rec.source.line,
          record: rec.id,
          field: 'tokenizer',
        });
      }
      this.#encoder ??= new ChatEncoder(await resolveTokenizer(this.#opts.tokenizer));
      checkResponseVocab(rec, this.#opts.vocabSize ?? this.#encoder.tokenizer.vocabSize);
      const built = timelineFromChat(rec, this.#encoder, this.#policy);
      if (built.drifted) stats.driftedMessages++;
      // The message-level merge compares text and tokens, which are alike for two images of one size: a call with
      // images goes to the forest as its own sample, where the images' identities keep them apart and share what repeats.
      item = hasImages(rec) ? this.#encoder.expandImages(rec, timelineToSample(built.timeline)) : built.timeline;
      stats.seconds.tokenize += (performance.now() - t0) / 1000;
      stats.chatSamples++;
      stats.tokenizer = this.#tokenizerName();
      stats.tokenizerCache = this.#encoder.stats;
    } else {
      item = timelineFromSample(rec) ?? rec;
    }
    stats.timelines++;
    stats.timelineTokens += 'kind' in item ? item.tokens.length : timelineLength(item);
    if (this.#episode.length > 0 && this.#episode[0].episode !== rec.episode) this.#flushEpisode();
    this.#episode.push(item);
  }

  #flushEpisode(): void {
    const items = this.#episode;
    if (items.length === 0) return;
    this.#episode = [];
    const stats = this.report;
    const t0 = performance.now();
    let samples: Sample[];
    if (this.#opts.merge !== false) {
      const timelines = items.filter((x): x is Timeline => !('kind' in x));
      const { samples: merged, report } = mergeTimelines(timelines, this.#policy);
      samples = merged.concat(items.filter((x): x is Sample => 'kind' in x)).sort((a, b) => byId(a.id, b.id));
      stats.absorbed += report.absorbed;
      stats.apart += report.apart;
      stats.driftedMessages += report.driftedMessages;
      addSnaps(stats.snaps, report.snaps);
    } else {
      samples = items.map((x) => ('kind' in x ? x : timelineToSample(x)));
      if (this.#policy.detectTimelineSnap)
        addSnaps(
          stats.snaps,
          snapsOnly(
            items.filter((x): x is Timeline => !('kind' in x)),
            this.#policy,
          ),
        );
    }
    stats.seconds.merge += (performance.now() - t0) / 1000;
    for (const s of samples) this.#addSample(s);
  }

  #addSample(sample: Sample): void {
    const windowTokens = this.#opts.windowTokens;
    const prev = this.#pending[this.#pending.length - 1];
    // Groups share their prompts, and advantages need whole groups: a group is split (at an episode boundary) only
    // when no estimator runs and it alone outgrows the window several times.
    const splitGroup = this.#opts.advantages === 'none' && prev?.episode !== sample.episode && this.#pendingTokens >= 4 * windowTokens;
    if (prev && ((prev.group !== sample.group && this.#pendingTokens >= windowTokens) || splitGroup)) this.#flushWindow();
    if (this.#pendingTokens + sample.tokens.length > MAX_TOKENS) {
      throw new TreepackError('E_LIMIT', `one episode exceeds ${MAX_TOKENS} naive tokens; a micro-batch indexes tokens with int32`, {
        file: sample.source.file,
        line: sample.source.line,
        record: sample.id,
      });
    }
    this.#pending.push(sample);
    this.#pendingTokens += sample.tokens.length;
    this.report.samples++;
    this.report.naiveTokens += sample.tokens.length;
    this.#opts.onProgress?.(this.report);
  }

  /** The planner's choice and the shared pieces of a window, for the manifest's parallel_plans and shared_prefixes. */
  #recordParallel(plan: Plan, samples: readonly Sample[], step: number, steps: number): void {
    if (plan.choice) {
      const { mode, cp, why, candidates } = plan.choice;
      (this.report.parallelPlans ??= []).push({ step, steps, mode, cp, why, candidates });
    }
    for (const piece of plan.sharedPrefixes ?? []) {
      const { sequence, start, end, ranks, ranges } = piece;
      (this.report.sharedPrefixes ??= []).push({ id: this.#pieces++, step, sequence: samples[sequence].id, start, end, ranks, ranges });
    }
  }

  #flushWindow(): void {
    const stats = this.report;
    const estimator = this.#opts.advantages;
    // Estimated advantages go on copies: a caller's records stay as given.
    const pending = this.#pending.map((s) => (estimator !== 'none' && needsAdvantage(s) ? { ...s } : s));
    if (estimator !== 'none') {
      // Only groups whose advantages are estimated here need to be whole; samples without rewards may repeat a group.
      const estimated = pending.filter(needsAdvantage);
      for (const s of estimated) {
        if (this.#flushedGroups.has(s.group)) {
          throw new TreepackError(
            'E_INPUT',
            `group ${JSON.stringify(s.group)} appears again after its micro-batch was written: advantages need a group's records to be contiguous in the input`,
            {
              file: s.source.file,
              line: s.source.line,
              record: s.id,
              field: 'group',
            },
          );
        }
      }
      fillAdvantages(pending, { estimator });
      for (const s of estimated) this.#flushedGroups.add(s.group);
    }
    const t0 = performance.now();
    const packForest = this.#kernel!.kernel;
    const budget = this.#opts.budget;
    const routeStats = { conflicts: 0, unsplitTokens: 0, splitTokens: 0 };
    const assemble = {
      ...this.#vocabulary(),
      packForest,
      turnIds: this.#opts.turnIds,
      routeConflict: this.#opts.routeConflict,
      routeStats,
    };
    let out: Packed[];
    if (budget) {
      const [stepBase, pieceBase] = [this.#steps, this.#pieces];
      const w = packWindow(pending, { ...budget, ...assemble, sharedPieceBase: pieceBase });
      out = w.microBatches.map((mb) => ({ batch: mb.batch, samples: mb.samples, plan: mb.plan, stepBase, pieceBase }));
      const steps = w.plan.microBatches.reduce((a, m) => Math.max(a, m.step + 1), 0);
      this.#steps += steps;
      this.#recordParallel(w.plan, pending, stepBase, steps);
      stats.optimumTokens += w.plan.optimumTokens;
      w.plan.rankCosts.forEach((c, r) => (stats.rankCosts[r] = (stats.rankCosts[r] ?? 0) + c));
      const pr = w.plan.prefixReuse;
      if (pr) {
        const acc = (stats.prefixReuse ??= { computedTokens: 0, pushedTokens: 0, peakCachedTokens: 0 });
        acc.computedTokens += pr.computedTokens;
        acc.pushedTokens += pr.pushedTokens;
        acc.peakCachedTokens = Math.max(acc.peakCachedTokens, pr.peakCachedTokens);
        if (pr.sharedTokens !== undefined) acc.sharedTokens = (acc.sharedTokens ?? 0) + pr.sharedTokens;
        if (pr.peakCachedBytes !== undefined) acc.peakCachedBytes = Math.max(acc.peakCachedBytes ?? 0, pr.peakCachedBytes);
      }
    } else {
      out = [{ batch: assembleMicroBatch(pending, assemble), samples: pending }];
      stats.optimumTokens += out[0].batch.meta.num_tokens_packed;
    }
    stats.seconds.pack += (performance.now() - t0) / 1000;
    for (const p of out) stats.packedTokens += p.batch.meta.num_tokens_packed;
    if (out.some((p) => p.batch.routes)) {
      const r = (stats.routes ??= { policy: this.#opts.routeConflict, conflicts: 0, unsplitTokens: 0, splitTokens: 0 });
      r.conflicts += routeStats.conflicts;
      r.unsplitTokens += routeStats.unsplitTokens;
      r.splitTokens += routeStats.splitTokens;
    }
    stats.microBatches += out.length;
    this.#pending = [];
    this.#pendingTokens = 0;
    this.#ready.push(...out);
  }
}
