/**
 * Aggregation of per-token losses into one number. Every mode is a weighted sum Σ w_i·L_t over trainable tokens,
 * with one weight per sequence; global normalisers replace the micro-batch's own counts so that data-parallel
 * micro-batches sum to the global loss.
 *   token-mean               w = 1/T          (T trainable tokens)
 *   seq-mean-token-sum       w = 1/G          (G sequences with ≥ 1 trainable token)
 *   seq-mean-token-mean      w = 1/(G·n_i)    (n_i trainable tokens of sequence i)
 *   seq-mean-token-sum-norm  w = 1/norm_constant
 */
import type { LossConfig } from './config.js';

export interface Normalisers {
  tokens: number; // T, or global_tokens
  sequences: number; // G, or global_sequences
}

/** Trainable tokens per sequence, written into `counts` [S]; returns the normalisers. */
export function countTrainable(seq_offsets: Int32Array, loss_mask: Uint8Array, cfg: LossConfig, counts: Int32Array): Normalisers {
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

/** The weight of every trainable token of a sequence with n > 0 trainable tokens. */
export function sequenceWeight(cfg: LossConfig, n: number, norm: Normalisers): number {
  switch (cfg.aggregation) {
    case 'token-mean':
      return 1 / norm.tokens;
    case 'seq-mean-token-sum':
      return 1 / norm.sequences;
    case 'seq-mean-token-mean':
      return 1 / (norm.sequences * n);
    case 'seq-mean-token-sum-norm':
      return 1 / cfg.norm_constant;
  }
}
