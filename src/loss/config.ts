/**
 * The loss configuration (`loss.json` for the CLI, an object for the API): names, defaults and validation. Every
 * backend receives the validated, fully defaulted form, so they never see an unknown name or a missing value.
 * Semantics follow verl's core_algos (test/fixtures/loss_reference.json is a worked example).
 */
import { describeValue, TreepackError } from '../errors.js';

export const POLICY_LOSSES = ['ppo', 'gspo', 'cispo'] as const;
export const AGGREGATIONS = [
  'token-mean',
  'seq-mean-token-sum',
  'seq-mean-token-mean',
  'seq-mean-token-sum-norm',
  'seq-mean-turn-mean-token-mean',
] as const;
export const KL_ESTIMATORS = ['none', 'k1', 'abs', 'k2', 'k3'] as const;
export const TIS_LEVELS = ['none', 'token', 'sequence'] as const;

export type PolicyLoss = (typeof POLICY_LOSSES)[number];
export type Aggregation = (typeof AGGREGATIONS)[number];
export type KlEstimator = (typeof KL_ESTIMATORS)[number];
export type TisLevel = (typeof TIS_LEVELS)[number];

/** The loss configuration, as the C ABI, the CLI's `--config` and Python's LossConfig name its fields. */
export interface LossConfig {
  /**
   * `ppo`: clipped ratio (asymmetric ε, optional dual clip); `gspo`: sequence-level ratio; `cispo`: clipped, detached IS
   * weight times lp.
   */
  policy: PolicyLoss;
  clip_low: number; // ε_low ≥ 0: the ratio is clipped to [1 − clip_low, 1 + clip_high]
  clip_high: number; // ε_high ≥ 0
  /** Dual-clip constant c > 1 for negative advantages (ppo only); 0 = off. */
  dual_clip: number;
  /** |lp − old| (and every other log ratio) is clamped to this before exp. */
  log_ratio_clamp: number;
  /**
   * How per-token losses become one number (docs/concepts/loss.md, src/loss/aggregate.ts). `seq-mean-turn-mean-token-mean`
   * is AgentFlow's Flow-GRPO: each turn's token mean, the mean over the sequence's turns, then over sequences; it
   * reads the micro-batch's `turn_ids`.
   */
  aggregation: Aggregation;
  /** The fixed divisor of `seq-mean-token-sum-norm` (e.g. the longest response length). */
  norm_constant: number;
  /** Global normalisers (0 = this micro-batch's own): trainable tokens for token-mean, non-empty sequences for seq-mean-*. */
  global_tokens: number;
  global_sequences: number;
  /**
   * Multiplies the loss, pg_loss, kl_loss and the gradient (verl's and AReaL's ×dp when each rank's loss is
   * averaged by data parallelism but was normalised by global counts); the per-token metrics are not scaled.
   */
  loss_scale: number;
  kl: KlEstimator; // KL to ref_logprobs as a loss term
  kl_coef: number;
  /** Truncated importance weights min(exp(old − rollout), tis_cap), detached, from rollout_logprobs. */
  tis: TisLevel;
  tis_cap: number;
}

/** The loss config a field left out takes; clip_high defaults to clip_low. */
export const DEFAULT_LOSS_CONFIG: Readonly<LossConfig> = Object.freeze({
  policy: 'ppo',
  clip_low: 0.2,
  clip_high: 0.2,
  dual_clip: 0,
  log_ratio_clamp: 20,
  aggregation: 'token-mean',
  norm_constant: 0,
  global_tokens: 0,
  global_sequences: 0,
  loss_scale: 1,
  kl: 'none',
  kl_coef: 0,
  tis: 'none',
  tis_cap: 2,
});

const NAMES: Record<string, readonly string[]> = { policy: POLICY_LOSSES, aggregation: AGGREGATIONS, kl: KL_ESTIMATORS, tis: TIS_LEVELS };

function bad(field: string, expected: string, v: unknown): TreepackError {
  return new TreepackError('E_ARG', `Expected ${expected} for ${field} but received ${describeValue(v)}`, { field });
}

/**
 * Fills defaults and checks every field; throws TreepackError E_ARG naming the field (`clip_low`, `dual_clip`, …).
 * `clip_high` defaults to `clip_low`. Unknown keys are refused: a misspelled option must not silently do nothing.
 */
export function resolveLossConfig(input: Partial<LossConfig> | Record<string, unknown> = {}): LossConfig {
  if (input === null || typeof input !== 'object' || Array.isArray(input)) throw bad('loss config', 'an object', input);
  const given = input as Record<string, unknown>;
  for (const key of Object.keys(given)) {
    if (!(key in DEFAULT_LOSS_CONFIG)) {
      throw new TreepackError(
        'E_ARG',
        `unknown loss option ${JSON.stringify(key)}; expected one of ${Object.keys(DEFAULT_LOSS_CONFIG).join(', ')}`,
        { field: key },
      );
    }
  }
  const cfg = { ...DEFAULT_LOSS_CONFIG, ...(given as Partial<LossConfig>) };
  if (given.clip_high === undefined) cfg.clip_high = cfg.clip_low;
  for (const [field, names] of Object.entries(NAMES)) {
    const v = (cfg as unknown as Record<string, unknown>)[field];
    if (typeof v !== 'string' || !names.includes(v)) throw bad(field, `one of ${names.join(', ')}`, v);
  }
  const num = (field: keyof LossConfig, ok: (x: number) => boolean, expected: string) => {
    const v = cfg[field];
    if (typeof v !== 'number' || !Number.isFinite(v) || !ok(v)) throw bad(field, expected, v);
  };
  num('clip_low', (x) => x >= 0, 'a number ≥ 0');
  num('clip_high', (x) => x >= 0, 'a number ≥ 0');
  num('dual_clip', (x) => x === 0 || x > 1, 'a number > 1 (or 0 for no dual clip)');
  num('log_ratio_clamp', (x) => x > 0, 'a number > 0');
  num('norm_constant', (x) => x >= 0, 'a number > 0');
  num('global_tokens', (x) => x >= 0, 'a number ≥ 0 (0 = this micro-batch)');
  num('global_sequences', (x) => x >= 0, 'a number ≥ 0 (0 = this micro-batch)');
  num('loss_scale', (x) => x >= 0, 'a number ≥ 0');
  num('kl_coef', () => true, 'a finite number');
  num('tis_cap', (x) => x > 0, 'a number > 0');
  if (cfg.dual_clip !== 0 && cfg.policy !== 'ppo')
    throw bad('dual_clip', `0 with policy '${cfg.policy}' (dual clip applies to ppo)`, cfg.dual_clip);
  if (cfg.aggregation === 'seq-mean-token-sum-norm' && cfg.norm_constant <= 0) {
    throw bad('norm_constant', "a number > 0 with aggregation 'seq-mean-token-sum-norm'", cfg.norm_constant);
  }
  return cfg;
}

/** The integer codes of the enum fields: each name's index in its list (the C ABI's, src/backend/abi.ts). */
export function configCodes(cfg: LossConfig): { policy: number; aggregation: number; kl: number; tis: number } {
  return {
    policy: POLICY_LOSSES.indexOf(cfg.policy),
    aggregation: AGGREGATIONS.indexOf(cfg.aggregation),
    kl: KL_ESTIMATORS.indexOf(cfg.kl),
    tis: TIS_LEVELS.indexOf(cfg.tis),
  };
}
