/**
 * Aggregation of per-token losses into one number. Every mode is a weighted sum Σ w_j·L_j over trainable
 * occurrences j; global normalisers replace the micro-batch's own counts so that data-parallel micro-batches sum to
 * the global loss. For occurrence j of sequence i (turn k of it, for the turn mode):
 *   token-mean                     w = 1/T            (T trainable tokens)
 *   seq-mean-token-sum             w = 1/G            (G sequences with ≥ 1 trainable token)
 *   seq-mean-token-mean            w = 1/(G·n_i)      (n_i trainable tokens of sequence i)
 *   seq-mean-token-sum-norm        w = 1/norm_constant
 *   seq-mean-turn-mean-token-mean  w = 1/(G·K_i·n_ik) (K_i turns of sequence i with ≥ 1 trainable token, n_ik those
 *                                                      of turn k: AgentFlow's Flow-GRPO)
 * then w ×= seq_weight[i] × loss_scale. The counts never look at seq_weight: a weight of 0 removes a sequence's terms
 * from the loss, not its tokens from T or G (mask them out for that).
 *
 * A turn is a run of equal `turn_ids` inside a sequence (validate.ts checks they never decrease along one).
 */
import type { LossConfig } from './config.js';
import type { LossBatch } from './types.js';

interface Normalisers {
  tokens: number; // T, or global_tokens
  sequences: number; // G, or global_sequences
}

/** Trainable tokens per sequence, written into `counts` [S]; returns the normalisers. */
function countTrainable(seq_offsets: Int32Array, loss_mask: Uint8Array, cfg: LossConfig, counts: Int32Array): Normalisers {
  let tokens = 0;
  let sequences = 0;
  for (let i = 0; i + 1 < seq_offsets.length; i++) {
    let n = 0;
    for (let j = seq_offsets[i]; j < seq_offsets[i + 1]; j++) n += loss_mask[j] ? 1 : 0;
    counts[i] = n;
    tokens += n;
    if (n > 0) sequences++;
  }
  return { tokens: cfg.global_tokens || tokens, sequences: cfg.global_sequences || sequences };
}

/**
 * The weight of every trainable token of a sequence with n > 0 trainable tokens, before seq_weight and loss_scale (not
 * for the turn mode).
 */
function sequenceWeight(cfg: LossConfig, n: number, norm: Normalisers): number {
  switch (cfg.aggregation) {
    case 'token-mean':
      return 1 / norm.tokens;
    case 'seq-mean-token-sum':
      return 1 / norm.sequences;
    case 'seq-mean-token-mean':
      return 1 / (norm.sequences * n);
    case 'seq-mean-token-sum-norm':
      return 1 / cfg.norm_constant;
    case 'seq-mean-turn-mean-token-mean':
      throw new Error('the turn mode weighs each turn: occurrenceWeights');
  }
}

export interface Weights {
  /** [M]: the aggregation weight of each trainable occurrence, seq_weight and loss_scale included; 0 elsewhere. */
  weights: Float64Array;
  /** [S]: trainable tokens per sequence. */
  counts: Int32Array;
}

/** The weight of every occurrence (see the file comment); inputs validated (validate.ts). */
export function occurrenceWeights(b: Pick<LossBatch, 'seq_offsets' | 'loss_mask' | 'seq_weight' | 'turn_ids'>, cfg: LossConfig): Weights {
  const { seq_offsets: off, loss_mask: mask, seq_weight: sw, turn_ids: turn } = b;
  const S = off.length - 1;
  const counts = new Int32Array(S);
  const norm = countTrainable(off, mask, cfg, counts);
  const weights = new Float64Array(off[S]);
  const turns = cfg.aggregation === 'seq-mean-turn-mean-token-mean';
  for (let i = 0; i < S; i++) {
    if (counts[i] === 0) continue;
    const scale = (sw ? sw[i] : 1) * cfg.loss_scale;
    const a = off[i];
    const e = off[i + 1];
    if (!turns) {
      const w = sequenceWeight(cfg, counts[i], norm) * scale;
      for (let j = a; j < e; j++) if (mask[j]) weights[j] = w;
      continue;
    }
    // Two walks over the runs of equal turn ids: K_i first, then each run's weight from its own count.
    let K = 0;
    for (let r = a; r < e;) {
      let n = 0;
      let q = r;
      for (; q < e && turn![q] === turn![r]; q++) n += mask[q];
      if (n > 0) K++;
      r = q;
    }
    for (let r = a; r < e;) {
      let n = 0;
      let q = r;
      for (; q < e && turn![q] === turn![r]; q++) n += mask[q];
      const w = n > 0 ? (1 / (norm.sequences * K * n)) * scale : 0;
      for (let j = r; j < q; j++) if (mask[j]) weights[j] = w;
      r = q;
    }
  }
  return { weights, counts };
}
