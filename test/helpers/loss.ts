/**
 * An independent float64 reference of the RL loss on the UNPACKED batch (plain arrays per sequence, written from
 * the formulas in test/fixtures/loss_reference.json, sharing no code with src/loss), and random packed batches
 * whose node logprobs are a function of the node's prefix, so the unpacked view needs no forest at all.
 */
import { expect } from 'vitest';
import type { LossConfig } from '../../src/loss/config.js';
import { FORMAT, type MicroBatch } from '../../src/pack/contract.js';
import { packForest } from '../../src/pack/forest.js';
import { csr, rng } from './sequences.js';

export interface UnpackedSeq {
  lp: number[]; // per token t ≥ 0 (t = 0 is never trainable)
  old: number[];
  ref: number[];
  roll: number[];
  adv: number[];
  mask: number[];
  /** The trainer's seq_weight of this sequence (1 when absent). */
  weight?: number;
}

export interface ReferenceOut {
  loss: number;
  pg_loss: number;
  kl_loss: number;
  clipfrac: number; // verl pg_clipfrac = high + low
  clipfrac_dual: number;
  approx_kl: number;
  ratio_min: number;
  ratio_max: number;
  ratio_mean: number;
  trainable_tokens: number;
}

const cl = (x: number, lo: number, hi: number) => Math.min(Math.max(x, lo), hi);

export function unpackedLoss(seqs: UnpackedSeq[], c: LossConfig): ReferenceOut {
  const perSeq: { pg: number[]; kl: number[]; weight: number }[] = [];
  const ratios: number[] = [];
  let clipped = 0;
  let dual = 0;
  let negKl = 0;
  for (const s of seqs) {
    const idx = s.mask.map((m, t) => (m ? t : -1)).filter((t) => t >= 0);
    const pg: number[] = [];
    const kl: number[] = [];
    const seqRatio = Math.exp(
      cl(idx.reduce((a, t) => a + s.lp[t] - s.old[t], 0) / Math.max(1, idx.length), -c.log_ratio_clamp, c.log_ratio_clamp),
    );
    const seqW = Math.min(
      Math.exp(
        cl(
          idx.reduce((a, t) => a + s.old[t] - s.roll[t], 0),
          -c.log_ratio_clamp,
          c.log_ratio_clamp,
        ),
      ),
      c.tis_cap,
    );
    for (const t of idx) {
      const A = s.adv[t];
      const r = c.policy === 'gspo' ? seqRatio : Math.exp(cl(s.lp[t] - s.old[t], -c.log_ratio_clamp, c.log_ratio_clamp));
      ratios.push(r);
      negKl += s.old[t] - s.lp[t];
      let L: number;
      if (c.policy === 'cispo') {
        L = -cl(r, 1 - c.clip_low, 1 + c.clip_high) * A * s.lp[t];
        if (r > 1 + c.clip_high || r < 1 - c.clip_low) clipped++;
      } else {
        const l1 = -A * r;
        const l2 = -A * cl(r, 1 - c.clip_low, 1 + c.clip_high);
        if (l2 > l1) clipped++;
        L = Math.max(l1, l2);
        if (A < 0 && c.dual_clip > 0) {
          if (L > -A * c.dual_clip) dual++;
          L = Math.min(L, -A * c.dual_clip);
        }
      }
      const w =
        c.tis === 'token'
          ? Math.min(Math.exp(cl(s.old[t] - s.roll[t], -c.log_ratio_clamp, c.log_ratio_clamp)), c.tis_cap)
          : c.tis === 'sequence'
            ? seqW
            : 1;
      pg.push(L * w);
      const d = s.lp[t] - s.ref[t];
      if (c.kl === 'k1') kl.push(d);
      else if (c.kl === 'abs') kl.push(Math.abs(d));
      else if (c.kl === 'k2') kl.push(0.5 * d * d);
      else if (c.kl === 'k3') {
        const x = cl(-d, -20, 20);
        kl.push(cl(Math.exp(x) - x - 1, -10, 10));
      } else kl.push(0);
    }
    perSeq.push({ pg, kl, weight: s.weight ?? 1 });
  }
  const T = c.global_tokens || ratios.length;
  const nonEmpty = perSeq.filter((s) => s.pg.length > 0);
  const G = c.global_sequences || nonEmpty.length;
  // Each sequence's part of the aggregate, times its weight, times loss_scale.
  const agg = (key: 'pg' | 'kl') => {
    const sum = (xs: number[]) => xs.reduce((a, b) => a + b, 0);
    if (ratios.length === 0) return 0;
    const weighted = (f: (s: (typeof perSeq)[number]) => number) => c.loss_scale * sum(nonEmpty.map((s) => s.weight * f(s)));
    switch (c.aggregation) {
      case 'token-mean':
        return weighted((s) => sum(s[key]) / T);
      case 'seq-mean-token-sum':
        return weighted((s) => sum(s[key]) / G);
      case 'seq-mean-token-mean':
        return weighted((s) => sum(s[key]) / s[key].length / G);
      case 'seq-mean-token-sum-norm':
        return weighted((s) => sum(s[key]) / c.norm_constant);
      case 'seq-mean-turn-mean-token-mean':
        throw new Error('the turn mode has its own reference on unmerged turns (test/loss-turns.test.ts)');
    }
  };
  const pg_loss = agg('pg');
  const kl_loss = agg('kl');
  const n = ratios.length;
  return {
    loss: pg_loss + c.kl_coef * kl_loss,
    pg_loss,
    kl_loss,
    clipfrac: n ? clipped / n : 0,
    clipfrac_dual: n ? dual / n : 0,
    approx_kl: n ? negKl / n : 0,
    ratio_min: n ? ratios.reduce((a, b) => Math.min(a, b)) : 0,
    ratio_max: n ? ratios.reduce((a, b) => Math.max(a, b)) : 0,
    ratio_mean: n ? ratios.reduce((a, b) => a + b, 0) / n : 0,
    trainable_tokens: n,
  };
}

/** A float32-exact pseudo-random value in [lo, hi) from integer keys. */
function hashValue(lo: number, hi: number, ...keys: number[]): number {
  let h = 0x811c9dc5;
  for (const k of keys) {
    h = Math.imul(h ^ (k & 0xffff), 0x01000193);
    h = Math.imul(h ^ (k >>> 16), 0x01000193);
  }
  h ^= h >>> 13;
  h = Math.imul(h, 0x5bd1e995);
  h ^= h >>> 15;
  return Math.fround(lo + ((h >>> 0) / 4294967296) * (hi - lo));
}

/** Prefix hash of every token position of every sequence: equal prefixes give equal keys. */
function prefixKeys(tokens: number[]): number[] {
  const keys: number[] = [];
  let h = 17;
  for (const t of tokens) {
    h = (Math.imul(h, 1000003) ^ (t + 1)) >>> 0;
    keys.push(h);
  }
  return keys;
}

export interface RandomLossCase {
  batch: MicroBatch;
  lp: Float32Array; // node logprobs
  unpacked: UnpackedSeq[];
}

/**
 * A packed batch of `seqs` with per-occurrence fields; lp of a node = a function of its prefix. When `sharedOld`,
 * old/ref logprobs are functions of the prefix too (so all occurrences of a node agree: compact mode applies);
 * otherwise they differ per occurrence. `layout` 'trie' packs with sharing, 'chains' gives every sequence its own
 * nodes (no sharing): both must give the same loss.
 */
export function randomLossCase(
  seqs: number[][],
  seed: number,
  opts: { sharedOld?: boolean; layout?: 'trie' | 'chains'; maskRate?: number } = {},
): RandomLossCase {
  const r = rng(seed);
  const s = csr(seqs);
  const M = s.tokens.length;
  const forest = opts.layout === 'chains' ? chains(s.offsets) : packForest(s);
  const N = forest.input_ids.length;
  const mask = new Uint8Array(M);
  const adv = new Float32Array(M);
  const old = new Float32Array(M);
  const ref = new Float32Array(M);
  const roll = new Float32Array(M);
  const lp = new Float32Array(N);
  const unpacked: UnpackedSeq[] = [];
  const groupAdv = seqs.map(() => Math.fround(r() * 4 - 2));
  for (let i = 0; i < seqs.length; i++) {
    const keys = prefixKeys(seqs[i]);
    const u: UnpackedSeq = { lp: [], old: [], ref: [], roll: [], adv: [], mask: [] };
    for (let t = 0; t < seqs[i].length; t++) {
      const j = s.offsets[i] + t;
      const k = keys[t];
      const m = t > 0 && r() >= (opts.maskRate ?? 0.3) ? 1 : 0;
      const lpv = hashValue(-3, 0, k, 1);
      const o = opts.sharedOld ? hashValue(-3, 0, k, 2) : Math.fround(lpv + (r() - 0.5) * 1.2);
      const rf = opts.sharedOld ? hashValue(-3, 0, k, 3) : Math.fround(lpv + (r() - 0.5));
      const ro = Math.fround(o + (r() - 0.5) * 0.8);
      const a = r() < 0.1 ? 0 : groupAdv[i];
      mask[j] = m;
      adv[j] = a;
      old[j] = o;
      ref[j] = rf;
      roll[j] = ro;
      lp[forest.seq_positions[j]] = lpv;
      u.lp.push(lpv);
      u.old.push(o);
      u.ref.push(rf);
      u.roll.push(ro);
      u.adv.push(a);
      u.mask.push(m);
    }
    unpacked.push(u);
  }
  const batch: MicroBatch = {
    ...forest,
    loss_mask: mask,
    advantages: adv,
    old_logprobs: old,
    ref_logprobs: ref,
    rollout_logprobs: roll,
    meta: {
      format: FORMAT,
      num_sequences: seqs.length,
      num_tokens_naive: M,
      num_tokens_packed: N,
      tokenizer: 't',
      sequence_ids: seqs.map((_, i) => String(i)),
    },
  };
  return { batch, lp, unpacked };
}

/** The layout with no sharing at all: node = occurrence. Not optimal, but a valid input for the loss. */
function chains(offsets: Int32Array) {
  const M = offsets[offsets.length - 1];
  const seq_positions = Int32Array.from({ length: M }, (_, j) => j);
  const parent = new Int32Array(M);
  const position_ids = new Int32Array(M);
  for (let i = 0; i + 1 < offsets.length; i++) {
    for (let j = offsets[i]; j < offsets[i + 1]; j++) {
      parent[j] = j === offsets[i] ? -1 : j - 1;
      position_ids[j] = j - offsets[i];
    }
  }
  return { input_ids: new Int32Array(M), position_ids, parent, subtree_end: new Int32Array(M), seq_offsets: offsets, seq_positions };
}

/** |a − b| ≤ tol · max(1, |b|). */
export function close(a: number, b: number, tol: number, what: string): void {
  expect(Math.abs(a - b), `${what}: ${a} vs ${b}`).toBeLessThanOrEqual(tol * Math.max(1, Math.abs(b)));
}

/** Configs covering every policy, aggregation, KL estimator, TIS level, the clamps and the global normalisers. */
export const LOSS_CONFIGS: Partial<LossConfig>[] = [
  {},
  { clip_low: 0.2, clip_high: 0.28, dual_clip: 3, aggregation: 'seq-mean-token-sum' },
  { clip_low: 0.1, clip_high: 0.3, aggregation: 'seq-mean-token-mean', kl: 'k3', kl_coef: 0.1 },
  { aggregation: 'seq-mean-token-sum-norm', norm_constant: 17, kl: 'k1', kl_coef: 0.05, tis: 'token', tis_cap: 1.5 },
  { policy: 'gspo', clip_low: 3e-4, clip_high: 4e-4, aggregation: 'seq-mean-token-mean', kl: 'k2', kl_coef: 0.2 },
  { policy: 'cispo', clip_low: 0.5, clip_high: 0.3, kl: 'abs', kl_coef: 0.3, tis: 'sequence', tis_cap: 3 },
  { log_ratio_clamp: 0.25, dual_clip: 1.5, global_tokens: 500 },
  { aggregation: 'seq-mean-token-mean', global_sequences: 90, tis: 'sequence' },
];
