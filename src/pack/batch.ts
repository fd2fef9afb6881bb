/**
 * Samples → one packed micro-batch: concatenates the per-token fields in input order (the occurrence arrays of
 * the contract, turn ids included) and builds the forest with whichever packer the caller resolved.
 */
import { TreepackError } from '../errors.js';
import type { Sample } from '../records/types.js';
import {
  FORMAT,
  MAX_TOKENS,
  OCCURRENCE_FLOAT_FIELDS,
  type Forest,
  type MicroBatch,
  type OccurrenceFloatField,
  type Sequences,
} from './contract.js';
import { keyByRoutes, nodeRoutes, type RouteConflictPolicy, type RouteStats } from './routes.js';
import { imageTable, imageTensors, keyImages, type ImageTable } from './images.js';
import { sampleTurnIds } from './turns.js';

/**
 * Concatenates token sequences into CSR form. `idOf(i)` names sequence i in the error when the total passes the
 * int32 positions of the contract.
 */
export function concatSequences(seqs: readonly ArrayLike<number>[], idOf: (i: number) => string = String): Sequences {
  const offsets = new Int32Array(seqs.length + 1);
  let m = 0;
  for (let i = 0; i < seqs.length; i++) {
    m += seqs[i].length;
    if (m > MAX_TOKENS) {
      throw new TreepackError('E_LIMIT', `micro-batch exceeds ${MAX_TOKENS} naive tokens (int32 positions)`, { record: idOf(i) });
    }
    offsets[i + 1] = m;
  }
  const tokens = new Int32Array(m);
  for (let i = 0; i < seqs.length; i++) tokens.set(seqs[i], offsets[i]);
  return { tokens, offsets };
}

/**
 * Concatenates sample tokens into CSR form: the sequences every forest, plan and statistic is built from. Image
 * placeholders come out as their images' keys (src/pack/images.ts), so an image is part of its nodes' identity.
 */
export function toSequences(samples: readonly Sample[], table: ImageTable | undefined = imageTable(samples)): Sequences {
  const seqs = concatSequences(
    samples.map((s) => s.tokens),
    (i) => samples[i].id,
  );
  if (table) keyImages(samples, seqs, table);
  return seqs;
}

/**
 * A float occurrence field is written only when every sample provides it: a partial column would need a
 * placeholder value, and a placeholder in a trainable position would silently enter the loss.
 */
function floatField(samples: readonly Sample[], offsets: Int32Array, field: OccurrenceFloatField): Float32Array | undefined {
  const has = (s: Sample) => s[field] !== undefined || (field === 'advantages' && s.advantage !== undefined);
  const first = samples.findIndex(has);
  if (first < 0) return undefined;
  const missing = samples.find((s) => !has(s));
  if (missing) {
    throw new TreepackError(
      'E_INPUT',
      `sample ${JSON.stringify(samples[first].id)} has ${field} but this one has none; a micro-batch needs it on every sample or none`,
      { file: missing.source.file, line: missing.source.line, record: missing.id, field },
    );
  }
  const out = new Float32Array(offsets[samples.length]);
  for (let i = 0; i < samples.length; i++) {
    const s = samples[i];
    const v = s[field];
    if (v) out.set(v, offsets[i]);
    else out.fill(s.advantage!, offsets[i], offsets[i + 1]);
  }
  return out;
}

/** Turn ids (src/pack/turns.ts); a sample without message boundaries is one turn (id 0): its tokens are one span. */
function turnField(samples: readonly Sample[], offsets: Int32Array): Int32Array {
  const out = new Int32Array(offsets[samples.length]);
  samples.forEach((s, i) => {
    const t = sampleTurnIds(s);
    if (t) out.set(t, offsets[i]);
  });
  return out;
}

export interface AssembleOptions {
  tokenizer: string;
  /** One past the largest token id of the tokenizer (or the caller's vocabSize); written when known. */
  vocabSize?: number;
  packForest: (seqs: Sequences) => Forest;
  /** Write `turn_ids` (the packer's `turnIds` option). */
  turnIds?: boolean;
  /** Where routes of a shared prefix differ (src/pack/routes.ts); default `split`. */
  routeConflict?: RouteConflictPolicy;
  /** Accumulates what keying by routes cost, when given. */
  routeStats?: RouteStats;
}

/** Packs `samples` into one micro-batch: their forest (by `opts.packForest`) plus the per-occurrence fields in input order. */
export function assembleMicroBatch(samples: readonly Sample[], opts: AssembleOptions): MicroBatch {
  const table = imageTable(samples);
  const seqs = toSequences(samples, table);
  // Routes key the image-keyed sequences: a node is its token (or image placeholder) and its route.
  const keyed = keyByRoutes(samples, seqs, opts.routeConflict ?? 'split', opts.packForest);
  const forest = keyed.forest ?? opts.packForest(keyed.seqs);
  const { tokenOf } = keyed;
  if (tokenOf) forest.input_ids = forest.input_ids.map((key) => tokenOf[key]);
  const images = table && imageTensors(samples, forest, table);
  const M = seqs.tokens.length;
  const loss_mask = new Uint8Array(M);
  for (let i = 0; i < samples.length; i++) {
    const off = seqs.offsets[i];
    loss_mask.set(samples[i].loss_mask, off);
    // Token 0 of a sequence has no logprob (nothing precedes it), whatever the record said.
    if (samples[i].tokens.length > 0) loss_mask[off] = 0;
  }
  const mb: MicroBatch = {
    ...forest,
    loss_mask,
    meta: {
      format: FORMAT,
      num_sequences: samples.length,
      num_tokens_naive: M,
      num_tokens_packed: forest.input_ids.length,
      tokenizer: opts.tokenizer,
      sequence_ids: samples.map((s) => s.id),
      ...(opts.vocabSize !== undefined && { vocab_size: opts.vocabSize }),
      ...images?.meta,
    },
    ...images?.tensors,
  };
  for (const f of OCCURRENCE_FLOAT_FIELDS) {
    const col = floatField(samples, seqs.offsets, f);
    if (col) mb[f] = col;
  }
  if (opts.turnIds) mb.turn_ids = turnField(samples, seqs.offsets);
  const { layers, topK } = keyed;
  if (layers !== undefined && topK !== undefined) {
    mb.routes = nodeRoutes(samples, forest.seq_positions, forest.input_ids.length, layers, topK);
    mb.meta.routes_layers = layers;
    mb.meta.routes_top_k = topK;
    if (opts.routeStats) {
      opts.routeStats.conflicts += keyed.conflicts;
      opts.routeStats.unsplitTokens += keyed.unsplitTokens;
      opts.routeStats.splitTokens += forest.input_ids.length;
    }
  }
  return mb;
}
