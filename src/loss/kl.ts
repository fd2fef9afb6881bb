/**
 * KL to the reference policy as a loss term, per token (verl's kl_penalty): k1 = lp − ref, abs = |lp − ref|,
 * k2 = ½(lp − ref)², k3 (low-variance) = exp(x) − x − 1 with x = clamp(ref − lp, ±20), clamped to [−10, 10].
 */
import { KL_ESTIMATORS } from './config.js';
import { clamp } from './policy.js';

/** The estimators' codes: their index in KL_ESTIMATORS. */
const KL_K1 = KL_ESTIMATORS.indexOf('k1');
const KL_ABS = KL_ESTIMATORS.indexOf('abs');
const KL_K2 = KL_ESTIMATORS.indexOf('k2');
const KL_K3 = KL_ESTIMATORS.indexOf('k3');

/** verl's fixed clamps for k3. */
export const K3_LOG_CLAMP = 20;
export const K3_VALUE_CLAMP = 10;

/** Writes [kl, dkl/dlp] into out. */
export function klTerm(kind: number, lp: number, ref: number, out: Float64Array): void {
  const diff = lp - ref;
  switch (kind) {
    case KL_K1:
      out[0] = diff;
      out[1] = 1;
      return;
    case KL_ABS:
      out[0] = Math.abs(diff);
      out[1] = diff > 0 ? 1 : diff < 0 ? -1 : 0;
      return;
    case KL_K2:
      out[0] = 0.5 * diff * diff;
      out[1] = diff;
      return;
    case KL_K3: {
      const x = -diff;
      const e = Math.exp(clamp(x, -K3_LOG_CLAMP, K3_LOG_CLAMP));
      const v = e - clamp(x, -K3_LOG_CLAMP, K3_LOG_CLAMP) - 1;
      const inside = x >= -K3_LOG_CLAMP && x <= K3_LOG_CLAMP && v <= K3_VALUE_CLAMP && v >= -K3_VALUE_CLAMP;
      out[0] = clamp(v, -K3_VALUE_CLAMP, K3_VALUE_CLAMP);
      out[1] = inside ? 1 - e : 0;
      return;
    }
    default:
      out[0] = 0;
      out[1] = 0;
  }
}
