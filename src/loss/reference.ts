/**
 * The js backend: the loss, its gradient and metrics, per (sequence, token) occurrence exactly as on the unpacked
 * batch, accumulated in float64. This is the oracle every other backend is tested against.
 */
import type { LossConfig } from './config.js';
import { occurrenceWeights } from './aggregate.js';
import { klTerm } from './kl.js';
import { CLIPPED_DUAL, CLIPPED_HIGH, CLIPPED_LOW, cispo, clippedSurrogate, truncatedWeight } from './policy.js';
import { configCodes } from './config.js';
import type { CompactPlan, LossBatch, LossMetrics, LossResult } from './types.js';

/** Running sums behind LossMetrics, shared by the per-occurrence and the compact kernel. */
class MetricSums {
  pg = 0;
  kl = 0;
  n = 0;
  high = 0;
  low = 0;
  dual = 0;
  logRatio = 0;
  ratio = 0;
  min = Infinity;
  max = -Infinity;

  add(count: number, flags: number, ratio: number, oldMinusLp: number): void {
    if (count === 0) return;
    this.n += count;
    if (flags & CLIPPED_HIGH) this.high += count;
    if (flags & CLIPPED_LOW) this.low += count;
    if (flags & CLIPPED_DUAL) this.dual += count;
    this.ratio += count * ratio;
    this.logRatio += count * oldMinusLp;
    if (ratio < this.min) this.min = ratio;
    if (ratio > this.max) this.max = ratio;
  }

  finish(klCoef: number): LossMetrics {
    const loss = this.pg + klCoef * this.kl;
    const per = (x: number) => (this.n ? x / this.n : 0);
    return {
      loss,
      pg_loss: this.pg,
      kl_loss: this.kl,
      clipfrac_high: per(this.high),
      clipfrac_low: per(this.low),
      clipfrac_dual: per(this.dual),
      approx_kl: per(this.logRatio),
      ratio_min: this.n ? this.min : 0,
      ratio_max: this.n ? this.max : 0,
      ratio_mean: per(this.ratio),
      trainable_tokens: this.n,
    };
  }
}

/** Inputs are validated by the caller (validate.ts): lengths, indices in range, finite trainable values. */
export function lossReference(b: LossBatch, lp: Float32Array, cfg: LossConfig): LossResult {
  const { seq_offsets: off, seq_positions: pos, loss_mask: mask } = b;
  const adv = b.advantages!;
  const old = b.old_logprobs!;
  const ref = b.ref_logprobs;
  const roll = b.rollout_logprobs;
  const S = off.length - 1;
  const codes = configCodes(cfg);
  const { weights, counts } = occurrenceWeights(b, cfg);
  const grad = new Float64Array(lp.length);
  const tmp = new Float64Array(3);
  const sums = new MetricSums();

  for (let i = 0; i < S; i++) {
    const n = counts[i];
    if (n === 0) continue;
    const a = off[i];
    const e = off[i + 1];
    let seqLogRatio = 0;
    let seqTis = 1;
    if (cfg.policy === 'gspo') {
      for (let j = a; j < e; j++) if (mask[j]) seqLogRatio += lp[pos[j]] - old[j];
      seqLogRatio /= n;
    }
    if (cfg.tis === 'sequence') {
      let s = 0;
      for (let j = a; j < e; j++) if (mask[j]) s += old[j] - roll![j];
      seqTis = truncatedWeight(s, cfg.log_ratio_clamp, cfg.tis_cap);
    }
    for (let j = a; j < e; j++) {
      if (!mask[j]) continue;
      const p = pos[j];
      const x = lp[p];
      const w = weights[j];
      const tis = cfg.tis === 'token' ? truncatedWeight(old[j] - roll![j], cfg.log_ratio_clamp, cfg.tis_cap) : seqTis;
      const flags =
        cfg.policy === 'cispo'
          ? cispo(x, old[j], adv[j], cfg.clip_low, cfg.clip_high, cfg.log_ratio_clamp, tmp)
          : clippedSurrogate(
              cfg.policy === 'gspo' ? seqLogRatio : x - old[j],
              adv[j],
              cfg.clip_low,
              cfg.clip_high,
              cfg.log_ratio_clamp,
              cfg.dual_clip,
              tmp,
            );
      sums.pg += w * tis * tmp[0];
      let g = w * tis * tmp[1];
      sums.add(1, flags, tmp[2], old[j] - x);
      if (codes.kl) {
        klTerm(codes.kl, x, ref![j], tmp);
        sums.kl += w * tmp[0];
        g += cfg.kl_coef * w * tmp[1];
      }
      grad[p] += g;
    }
  }
  const metrics = sums.finish(cfg.kl_coef);
  return { loss: metrics.loss, grad: Float32Array.from(grad), metrics };
}

/**
 * The compact plan of a batch (see CompactPlan). Throws E_INPUT naming the field when two trainable occurrences
 * of one node disagree on old_logprobs (or ref_logprobs with KL on); refuses gspo, whose ratio is per sequence.
 */
export function compactPlan(b: LossBatch, cfg: LossConfig, fail: (field: string, message: string) => Error): CompactPlan {
  if (cfg.policy === 'gspo') throw fail('policy', "compact mode cannot run policy 'gspo': its ratio is per sequence, not per node");
  const N = b.input_ids.length;
  const { seq_offsets: off, seq_positions: pos, loss_mask: mask } = b;
  const adv = b.advantages!;
  const old = b.old_logprobs!;
  const withKl = cfg.kl !== 'none';
  const { weights, counts } = occurrenceWeights(b, cfg);
  const plan: CompactPlan = {
    num_nodes: N,
    old: new Float32Array(N),
    ref: new Float32Array(N),
    pos_weight: new Float32Array(N),
    neg_weight: new Float32Array(N),
    kl_weight: new Float32Array(N),
    n_train: new Int32Array(N),
    n_pos: new Int32Array(N),
    n_neg: new Int32Array(N),
    trainable_tokens: 0,
  };
  const posW = new Float64Array(N);
  const negW = new Float64Array(N);
  const klW = new Float64Array(N);
  for (let i = 0; i + 1 < off.length; i++) {
    if (counts[i] === 0) continue;
    let seqTis = 1;
    if (cfg.tis === 'sequence') {
      let s = 0;
      for (let j = off[i]; j < off[i + 1]; j++) if (mask[j]) s += old[j] - b.rollout_logprobs![j];
      seqTis = truncatedWeight(s, cfg.log_ratio_clamp, cfg.tis_cap);
    }
    for (let j = off[i]; j < off[i + 1]; j++) {
      if (!mask[j]) continue;
      const p = pos[j];
      if (plan.n_train[p] === 0) {
        plan.old[p] = old[j];
        if (withKl) plan.ref[p] = b.ref_logprobs![j];
      } else if (plan.old[p] !== old[j]) {
        throw fail(
          'old_logprobs',
          `occurrences of node ${p} have different old_logprobs (${plan.old[p]} and ${old[j]} at sequence ${i}); use the per-occurrence mode`,
        );
      } else if (withKl && plan.ref[p] !== b.ref_logprobs![j]) {
        throw fail(
          'ref_logprobs',
          `occurrences of node ${p} have different ref_logprobs (${plan.ref[p]} and ${b.ref_logprobs![j]} at sequence ${i}); use the per-occurrence mode`,
        );
      }
      const tis = cfg.tis === 'token' ? truncatedWeight(old[j] - b.rollout_logprobs![j], cfg.log_ratio_clamp, cfg.tis_cap) : seqTis;
      const A = adv[j];
      const w = weights[j];
      plan.n_train[p]++;
      if (A > 0) {
        posW[p] += w * tis * A;
        plan.n_pos[p]++;
      } else if (A < 0) {
        negW[p] -= w * tis * A;
        plan.n_neg[p]++;
      }
      klW[p] += w;
      plan.trainable_tokens++;
    }
  }
  plan.pos_weight.set(posW);
  plan.neg_weight.set(negW);
  plan.kl_weight.set(klW);
  return plan;
}

/**
 * The compact kernel on js: per node, P·(−min(r, 1+εh)) + Q·min(max(r, 1−εl), c) for ppo (the clipped surrogate
 * summed over the node's occurrences), −clip(r)·lp·(P − Q) for cispo, plus the KL term.
 */
export function lossCompactReference(plan: CompactPlan, lp: Float32Array, cfg: LossConfig): LossResult {
  const N = plan.num_nodes;
  const grad = new Float32Array(N);
  const kl = configCodes(cfg).kl;
  const tmp = new Float64Array(2);
  const sums = new MetricSums();
  const hiB = 1 + cfg.clip_high;
  const loB = 1 - cfg.clip_low;
  const C = cfg.log_ratio_clamp;
  for (let p = 0; p < N; p++) {
    const n = plan.n_train[p];
    if (n === 0) continue;
    const x = lp[p];
    const lr = x - plan.old[p];
    const r = Math.exp(Math.min(Math.max(lr, -C), C));
    const dr = lr >= -C && lr <= C ? r : 0;
    const P = plan.pos_weight[p];
    const Q = plan.neg_weight[p];
    let value: number;
    let g: number;
    if (cfg.policy === 'cispo') {
      const w = Math.min(Math.max(r, loB), hiB);
      value = -w * x * (P - Q);
      g = -w * (P - Q);
      const f = r > hiB ? CLIPPED_HIGH : r < loB ? CLIPPED_LOW : 0;
      sums.add(n, f, r, -lr);
    } else {
      // A > 0: −A·min(r, 1+εh); A < 0: |A|·max(r, 1−εl), capped at |A|·c by the dual clip.
      const highClipped = r > hiB;
      const lowClipped = r < loB;
      const up = lowClipped ? loB : r;
      const dualClipped = cfg.dual_clip > 0 && up > cfg.dual_clip;
      value = -P * (highClipped ? hiB : r) + Q * (dualClipped ? cfg.dual_clip : up);
      g = -P * (highClipped ? 0 : dr) + Q * (dualClipped || lowClipped ? 0 : dr);
      const posN = plan.n_pos[p];
      const negN = plan.n_neg[p];
      sums.add(n - posN - negN, 0, r, -lr);
      sums.add(posN, highClipped ? CLIPPED_HIGH : 0, r, -lr);
      sums.add(negN, (lowClipped ? CLIPPED_LOW : 0) | (dualClipped ? CLIPPED_DUAL : 0), r, -lr);
    }
    sums.pg += value;
    if (kl) {
      klTerm(kl, x, plan.ref[p], tmp);
      sums.kl += plan.kl_weight[p] * tmp[0];
      g += cfg.kl_coef * plan.kl_weight[p] * tmp[1];
    }
    grad[p] = g;
  }
  const metrics = sums.finish(cfg.kl_coef);
  return { loss: metrics.loss, grad, metrics };
}
