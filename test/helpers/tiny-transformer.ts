/**
 * A tiny decoder-only transformer in float64 on the autodiff tape: token embedding, 2 pre-norm layers (RMSNorm,
 * 2-head attention with RoPE driven by the given positions, SiLU MLP), final RMSNorm, unembedding. Attention is
 * restricted by a `visible(q, k)` predicate, so the same code runs a causal sequence or a packed forest.
 */
import { Tape } from './autodiff.js';
import { rng } from './sequences.js';

export const D = 8,
  HEADS = 2,
  HEAD_DIM = D / HEADS,
  FF = 16,
  LAYERS = 2;
const ROPE_BASE = 100; // positions here are small: a low base makes every rotation frequency matter

interface LayerParams {
  g1: number;
  wq: number;
  wk: number;
  wv: number;
  wo: number;
  g2: number;
  w1: number;
  w2: number;
}

/** Offsets of each weight in the flat parameter vector. */
export class Weights {
  readonly values: Float64Array;
  readonly emb = 0;
  readonly layers: LayerParams[] = [];
  readonly gf: number;
  readonly unemb: number;

  constructor(
    readonly vocab: number,
    seed: number,
  ) {
    let n = vocab * D;
    for (let l = 0; l < LAYERS; l++) {
      const at = (size: number) => ((n += size), n - size);
      this.layers.push({
        g1: at(D),
        wq: at(D * D),
        wk: at(D * D),
        wv: at(D * D),
        wo: at(D * D),
        g2: at(D),
        w1: at(D * FF),
        w2: at(FF * D),
      });
    }
    this.gf = n;
    n += D;
    this.unemb = n;
    n += D * vocab;
    const r = rng(seed);
    const normal = () => Math.sqrt(-2 * Math.log(1 - r())) * Math.cos(2 * Math.PI * r());
    this.values = Float64Array.from({ length: n }, () => 0.6 * normal());
    for (const g of [...this.layers.flatMap((l) => [l.g1, l.g2]), this.gf])
      for (let i = 0; i < D; i++) this.values[g + i] = 1 + 0.1 * normal();
  }
}

function rmsnorm(t: Tape, x: number[], p: number[], g: number): number[] {
  const ms = t.affine(t.sum(x.map((v) => t.mul(v, v))), 1 / x.length, 1e-6);
  const inv = t.pow(ms, -0.5);
  return x.map((v, i) => t.mul(t.mul(v, inv), p[g + i]));
}

/** y = x W for W stored row-major [in, out] at offset w. */
function matvec(t: Tape, x: number[], p: number[], w: number, out: number): number[] {
  const y: number[] = [];
  for (let j = 0; j < out; j++) {
    let s = t.mul(x[0], p[w + j]);
    for (let i = 1; i < x.length; i++) s = t.add(s, t.mul(x[i], p[w + i * out + j]));
    y.push(s);
  }
  return y;
}

/** Rotates each head's dimension pairs (2m, 2m+1) by pos · base^(-2m / HEAD_DIM). */
function rope(t: Tape, x: number[], pos: number): number[] {
  const y = x.slice();
  for (let h = 0; h < HEADS; h++) {
    for (let m = 0; m < HEAD_DIM / 2; m++) {
      const angle = pos * ROPE_BASE ** ((-2 * m) / HEAD_DIM);
      const c = Math.cos(angle),
        s = Math.sin(angle);
      const i = h * HEAD_DIM + 2 * m;
      y[i] = t.add(t.affine(x[i], c), t.affine(x[i + 1], -s));
      y[i + 1] = t.add(t.affine(x[i], s), t.affine(x[i + 1], c));
    }
  }
  return y;
}

/**
 * Logits [n][vocab] (tape nodes) for tokens at the given positions; query q attends to the keys k with
 * visible(q, k), which must include q itself.
 */
export function forward(
  t: Tape,
  w: Weights,
  params: number[],
  tokens: ArrayLike<number>,
  positions: ArrayLike<number>,
  visible: (q: number, k: number) => boolean,
): number[][] {
  const n = tokens.length;
  let x: number[][] = [];
  for (let p = 0; p < n; p++) x.push(params.slice(w.emb + tokens[p] * D, w.emb + tokens[p] * D + D));
  for (const L of w.layers) {
    const h = x.map((v) => rmsnorm(t, v, params, L.g1));
    const q = h.map((v, p) => rope(t, matvec(t, v, params, L.wq, D), positions[p]));
    const k = h.map((v, p) => rope(t, matvec(t, v, params, L.wk, D), positions[p]));
    const v = h.map((u) => matvec(t, u, params, L.wv, D));
    const next: number[][] = [];
    for (let p = 0; p < n; p++) {
      const heads: number[] = [];
      for (let hd = 0; hd < HEADS; hd++) {
        const lo = hd * HEAD_DIM,
          hi = lo + HEAD_DIM;
        const keys: number[] = [];
        for (let s = 0; s < n; s++) if (visible(p, s)) keys.push(s);
        const scores = keys.map((s) => t.affine(t.dot(q[p].slice(lo, hi), k[s].slice(lo, hi)), 1 / Math.sqrt(HEAD_DIM)));
        // Subtracting the max (a constant on the tape) changes no value and no gradient of the softmax.
        const m = Math.max(...scores.map((s) => t.value(s)));
        const e = scores.map((s) => t.exp(t.affine(s, 1, -m)));
        const z = t.sum(e);
        for (let i = lo; i < hi; i++) heads.push(t.div(t.sum(keys.map((s, j) => t.mul(e[j], v[s][i]))), z));
      }
      const o = matvec(t, heads, params, L.wo, D);
      next.push(x[p].map((u, i) => t.add(u, o[i])));
    }
    x = next.map((u) => {
      const h2 = rmsnorm(t, u, params, L.g2);
      const a = matvec(t, h2, params, L.w1, FF).map((z) => t.div(z, t.affine(t.exp(t.affine(z, -1)), 1, 1)));
      const f = matvec(t, a, params, L.w2, D);
      return u.map((y, i) => t.add(y, f[i]));
    });
  }
  return x.map((u) => matvec(t, rmsnorm(t, u, params, w.gf), params, w.unemb, w.vocab));
}

/** log_softmax(logits)[token] on the tape. */
export function logprob(t: Tape, logits: number[], token: number): number {
  const m = Math.max(...logits.map((l) => t.value(l)));
  const lse = t.affine(t.log(t.sum(logits.map((l) => t.exp(t.affine(l, 1, -m))))), 1, m);
  return t.sub(logits[token], lse);
}

/** A fresh tape whose first nodes are the weights, so gradients index like `w.values`. */
export function tapeWithWeights(w: Weights): { tape: Tape; params: number[] } {
  const tape = new Tape();
  const params = Array.from(w.values, (v) => tape.leaf(v));
  return { tape, params };
}
