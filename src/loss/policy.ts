/**
 * Per-token policy-gradient terms (verl core_algos semantics). Each writes the loss value and its derivative with
 * respect to the token's logprob into `out` and returns which clip was active, so the kernels need no objects.
 */

/** Bits of the value returned: the metrics count them. */
export const CLIPPED_HIGH = 1;
export const CLIPPED_LOW = 2;
export const CLIPPED_DUAL = 4;

export function clamp(x: number, lo: number, hi: number): number {
  return x < lo ? lo : x > hi ? hi : x;
}

/**
 * The clipped surrogate max(−A·r, −A·clip(r, 1−εl, 1+εh)), then min(·, −A·c) for A < 0 when dual-clip c > 0, with
 * r = exp(clamp(logRatio, ±logClamp)). For ppo logRatio is lp − old; for GSPO it is the sequence's mean log ratio,
 * whose per-token derivative (verl's lp − sg(lp) + sg(mean) form) is r too. out = [loss, dloss/dlp, r].
 */
export function clippedSurrogate(
  logRatio: number,
  A: number,
  epsLow: number,
  epsHigh: number,
  logClamp: number,
  dualClip: number,
  out: Float64Array,
): number {
  const x = clamp(logRatio, -logClamp, logClamp);
  const r = Math.exp(x);
  const dr = logRatio >= -logClamp && logRatio <= logClamp ? r : 0;
  const l1 = -A * r;
  const l2 = -A * clamp(r, 1 - epsLow, 1 + epsHigh);
  let flags = 0;
  let loss = l1;
  let d = -A * dr;
  if (l2 > l1) {
    loss = l2;
    d = 0;
    flags = A > 0 ? CLIPPED_HIGH : CLIPPED_LOW;
  }
  if (A < 0 && dualClip > 0 && loss > -A * dualClip) {
    loss = -A * dualClip;
    d = 0;
    flags |= CLIPPED_DUAL;
  }
  out[0] = loss;
  out[1] = d;
  out[2] = r;
  return flags;
}

/** CISPO: −sg(clip(r, 1−εl, 1+εh))·A·lp; the clip only bounds the detached weight. out = [loss, dloss/dlp, r]. */
export function cispo(lp: number, old: number, A: number, epsLow: number, epsHigh: number, logClamp: number, out: Float64Array): number {
  const r = Math.exp(clamp(lp - old, -logClamp, logClamp));
  const w = clamp(r, 1 - epsLow, 1 + epsHigh);
  out[0] = -w * A * lp;
  out[1] = -w * A;
  out[2] = r;
  return r > 1 + epsHigh ? CLIPPED_HIGH : r < 1 - epsLow ? CLIPPED_LOW : 0;
}

/** Truncated importance weight min(exp(clamp(logW, ±logClamp)), cap): logW = old − rollout, per token or summed per sequence. */
export function truncatedWeight(logW: number, logClamp: number, cap: number): number {
  return Math.min(Math.exp(clamp(logW, -logClamp, logClamp)), cap);
}
