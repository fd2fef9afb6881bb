/**
 * The streaming path shared by `pack` and `stats`: records → samples → micro-batches, one micro-batch in memory
 * at a time. Stage times are measured here so both commands (and the bench) report the same figures.
 */
import { performance } from 'node:perf_hooks';
import type { Readable } from 'node:stream';
import { resolveKernel, type BackendName } from '../backend/index.js';
import { TreepackError } from '../errors.js';
import { fillAdvantages, type AdvantageEstimator } from '../loss/advantages.js';
import { assembleMicroBatch } from '../pack/batch.js';
import { MAX_TOKENS, type MicroBatch } from '../pack/contract.js';
import { readRecords, type ReadStats } from '../records/read.js';
import type { Sample } from '../records/types.js';
import { ChatEncoder, type SegmentCacheStats } from '../tokenize/chat.js';
import { loadTokenizer } from '../tokenize/tokenizer.js';

export interface PipelineOptions {
  /** Tokenizer directory (tokenizer.json + tokenizer_config.json); default Qwen3. */
  tokenizer?: string;
  backend?: BackendName | 'auto';
  /** Cut micro-batches at group boundaries once this many naive tokens are gathered. */
  maxNaiveTokens?: number;
  vocabSize?: number;
  /** Estimator for samples that have rewards but no advantages (per group, per episode); 'none' writes none. */
  advantages?: AdvantageEstimator | 'none';
  onProgress?: (p: PipelineStats) => void;
}

export interface PipelineStats {
  read: ReadStats; // input lines parsed and records they held (an episode line holds one per request)
  samples: number;
  chatSamples: number;
  naiveTokens: number;
  packedTokens: number;
  microBatches: number;
  seconds: { readParse: number; tokenize: number; pack: number };
  tokenizer: string;
  backend: string; // the packer's report: what ran and why
  tokenizerCache?: SegmentCacheStats;
}

export const DEFAULT_MAX_NAIVE_TOKENS = 4 * 1024 * 1024;

export interface Packed {
  batch: MicroBatch;
  samples: Sample[];
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
  const flush = (): Packed => {
    if (estimator !== 'none') {
      for (const s of pending) {
        if (flushedGroups.has(s.group)) {
          throw new TreepackError('E_LIMIT', `group ${JSON.stringify(s.group)} appears again after its micro-batch was written: advantages need a group's records to be contiguous in the input`, {
            file: s.source.file,
            line: s.source.line,
            record: s.id,
            field: 'group',
          });
        }
      }
      fillAdvantages(pending, { estimator });
      for (const s of pending) flushedGroups.add(s.group);
    }
    const t0 = performance.now();
    const batch = assembleMicroBatch(pending, { tokenizer: tokenizerName(), packForest: packer.kernel });
    stats.seconds.pack += (performance.now() - t0) / 1000;
    stats.packedTokens += batch.meta.num_tokens_packed;
    stats.microBatches++;
    const out = { batch, samples: pending };
    pending = [];
    pendingTokens = 0;
    return out;
  };

  const records = readRecords(input, { vocabSize: opts.vocabSize, stats: stats.read });
  for (;;) {
    let t0 = performance.now();
    const next = await records.next();
    stats.seconds.readParse += (performance.now() - t0) / 1000;
    if (next.done) break;
    const rec = next.value;
    let sample: Sample;
    if (rec.kind === 'chat') {
      t0 = performance.now();
      encoder ??= new ChatEncoder(await loadTokenizer(opts.tokenizer));
      sample = encoder.encode(rec);
      stats.seconds.tokenize += (performance.now() - t0) / 1000;
      stats.chatSamples++;
      stats.tokenizer = tokenizerName();
      stats.tokenizerCache = encoder.stats;
    } else {
      sample = rec;
    }
    const prev = pending[pending.length - 1];
    // Groups share their prompts, and advantages need whole groups: a group is split (at an episode boundary) only
    // when no estimator runs and it alone outgrows the budget several times.
    const splitGroup = estimator === 'none' && prev?.episode !== sample.episode && pendingTokens >= 4 * budget;
    if (prev && ((prev.group !== sample.group && pendingTokens >= budget) || splitGroup)) {
      yield flush();
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
  }
  if (pending.length) yield flush();
}

export function emptyStats(): PipelineStats {
  return {
    read: { lines: 0, records: 0 },
    samples: 0,
    chatSamples: 0,
    naiveTokens: 0,
    packedTokens: 0,
    microBatches: 0,
    seconds: { readParse: 0, tokenize: 0, pack: 0 },
    tokenizer: '',
    backend: '',
  };
}
