/**
 * Outcome advantages from scalar rewards, per group (GRPO family) and per batch (REINFORCE++ baseline), with
 * verl's conventions: unbiased std, ε in the denominator, a group of one has mean 0 and std 1.
 *
 * The unit is an episode (Flow-GRPO style): one reward per trajectory, and its advantage is broadcast to every
 * trainable token of every turn of that trajectory. Single-call data is the case of one-turn episodes.
 */
import { describeValue, TreepackError, type ErrorWhere } from '../errors.js';
import type { Sample } from '../records/types.js';

/** The advantage estimators (`--advantages`), group-normalised per task. */
export const ADVANTAGE_ESTIMATORS = ['grpo', 'dr-grpo', 'rloo', 'reinforce++-baseline'] as const;
/** One of ADVANTAGE_ESTIMATORS. */
export type AdvantageEstimator = (typeof ADVANTAGE_ESTIMATORS)[number];

export interface AdvantageOptions {
  estimator: AdvantageEstimator;
  /** Added to the std (GRPO) before dividing; default 1e-6 as verl. */
  epsilon?: number;
}

/** Dense group indices for group keys, in first-seen order. */
function groupIndex(groups: readonly string[]): { index: Int32Array; count: number } {
  const ids = new Map<string, number>();
  const index = new Int32Array(groups.length);
  for (let i = 0; i < groups.length; i++) {
    let g = ids.get(groups[i]);
    if (g === undefined) ids.set(groups[i], (g = ids.size));
    index[i] = g;
  }
  return { index, count: ids.size };
}

/**
 * One advantage per episode. `rewards[e]` and `groups[e]` describe episode e; `tokens[e]` (trainable tokens of
 * all its turns) weighs the REINFORCE++ batch whitening, which verl does over tokens.
 *
 * Any finite rewards work: each group is computed in units of a power of two near its largest |reward|, which
 * changes no bit of the result where the plain formulas stay in range (scaling by 2^k is exact) and keeps sums and
 * squares from overflowing where they would not (GRPO and the whitening are scale-free). An advantage that itself
 * lies outside float32, the micro-batch's dtype (Dr.GRPO or RLOO on rewards near 1e38), is an E_INPUT naming the
 * group.
 */
export function episodeAdvantages(
  rewards: ArrayLike<number>,
  groups: readonly string[],
  opts: AdvantageOptions,
  tokens?: ArrayLike<number>,
): Float64Array {
  return advantagesOf(rewards, groups, opts, tokens, () => ({}));
}

function advantagesOf(
  rewards: ArrayLike<number>,
  groups: readonly string[],
  opts: AdvantageOptions,
  tokens: ArrayLike<number> | undefined,
  where: (e: number) => ErrorWhere,
): Float64Array {
  const E = rewards.length;
  if (groups.length !== E)
    throw new TreepackError('E_ARG', `groups has ${groups.length} entries but rewards has ${E}`, { field: 'groups' });
  if (!(ADVANTAGE_ESTIMATORS as readonly string[]).includes(opts.estimator)) {
    throw new TreepackError(
      'E_ARG',
      `Expected one of ${ADVANTAGE_ESTIMATORS.join(', ')} for estimator but received ${describeValue(opts.estimator)}`,
      { field: 'estimator' },
    );
  }
  const eps = opts.epsilon ?? 1e-6;
  for (let e = 0; e < E; e++) {
    if (!Number.isFinite(rewards[e]))
      throw new TreepackError('E_INPUT', `reward of episode ${e} is ${rewards[e]}`, { ...where(e), field: 'reward' });
  }
  const { index, count } = groupIndex(groups);
  const n = new Float64Array(count);
  const unit = new Float64Array(count);
  for (let e = 0; e < E; e++) {
    n[index[e]]++;
    unit[index[e]] = Math.max(unit[index[e]], Math.abs(rewards[e]));
  }
  const largest = unit.slice();
  for (let g = 0; g < count; g++) unit[g] = powerOfTwoNear(unit[g]);
  const scaled = Float64Array.from({ length: E }, (_, e) => rewards[e] / unit[index[e]]);
  const mean = new Float64Array(count);
  const std = new Float64Array(count);
  for (let e = 0; e < E; e++) mean[index[e]] += scaled[e];
  for (let g = 0; g < count; g++) mean[g] = n[g] > 1 ? mean[g] / n[g] : 0;
  for (let e = 0; e < E; e++) std[index[e]] += (scaled[e] - mean[index[e]]) ** 2;
  for (let g = 0; g < count; g++) std[g] = Math.sqrt(std[g] / (n[g] - 1));

  // Group-of-one advantages (mean 0, std 1) in real units; the others in units of `unit` until the last step.
  const out = new Float64Array(E);
  for (let e = 0; e < E; e++) {
    const g = index[e];
    const r = rewards[e];
    const d = scaled[e] - mean[g];
    switch (opts.estimator) {
      case 'grpo':
        out[e] = n[g] > 1 ? d / (std[g] + eps / unit[g]) : r / (1 + eps);
        break;
      case 'dr-grpo':
      case 'reinforce++-baseline':
        out[e] = n[g] > 1 ? d * unit[g] : r;
        break;
      case 'rloo':
        // r − mean of the others = (r − mean)·n/(n−1)
        out[e] = n[g] > 1 ? ((d * n[g]) / (n[g] - 1)) * unit[g] : r;
        break;
    }
  }
  if (opts.estimator === 'reinforce++-baseline') {
    // Whitening is scale-free: run it in units of the largest group unit, where no difference can overflow.
    let top = 1;
    for (let g = 0; g < count; g++) top = Math.max(top, unit[g]);
    for (let e = 0; e < E; e++) {
      const g = index[e];
      out[e] = n[g] > 1 ? (scaled[e] - mean[g]) * (unit[g] / top) : rewards[e] / top;
    }
    whiten(out, tokens, 1e-8 / top / top);
  }
  for (let e = 0; e < E; e++) {
    if (!Number.isFinite(Math.fround(out[e]))) {
      throw new TreepackError(
        'E_INPUT',
        `the ${opts.estimator} advantage of episode ${e} in group ${JSON.stringify(groups[e])} is ${out[e]}, outside the float32 range the micro-batch stores (largest |reward| in the group: ${largest[index[e]]})`,
        { ...where(e), field: 'reward' },
      );
    }
  }
  return out;
}

/** A power of two within a factor 2 of m (1 for 0): dividing by it is exact. */
function powerOfTwoNear(m: number): number {
  return m === 0 ? 1 : 2 ** Math.floor(Math.log2(m));
}

/**
 * Token-weighted whitening over the batch (verl's masked_whiten: unbiased variance, `floor` = 1e-8 under the root, in
 * the units of `a`).
 */
function whiten(a: Float64Array, tokens: ArrayLike<number> | undefined, floor: number): void {
  let w = 0;
  let s = 0;
  for (let e = 0; e < a.length; e++) {
    const k = tokens ? tokens[e] : 1;
    w += k;
    s += k * a[e];
  }
  if (w === 0) return;
  const mean = s / w;
  let v = 0;
  for (let e = 0; e < a.length; e++) v += (tokens ? tokens[e] : 1) * (a[e] - mean) ** 2;
  const variance = w > 1 ? v / (w - 1) : 0;
  const scale = 1 / Math.sqrt(variance + floor);
  for (let e = 0; e < a.length; e++) a[e] = (a[e] - mean) * scale;
}

/**
 * Per-sample advantages for samples (turns) of episodes: episodes are keyed by `episode`, grouped by `group`, and
 * each takes its reward from its samples, which must agree. Returns one advantage per sample.
 */
export function sampleAdvantages(
  samples: readonly {
    id: string;
    group: string;
    episode: string;
    reward?: number;
    loss_mask: Uint8Array;
    source?: { file: string; line: number };
  }[],
  opts: AdvantageOptions,
): Float64Array {
  const episodeOf = new Map<string, number>();
  const rewards: number[] = [];
  const groups: string[] = [];
  const tokens: number[] = [];
  const which = new Int32Array(samples.length);
  const firstOf: number[] = []; // a sample of each episode, for error locations
  for (let i = 0; i < samples.length; i++) {
    const s = samples[i];
    const where = { file: s.source?.file, line: s.source?.line, record: s.id };
    if (s.reward === undefined)
      throw new TreepackError('E_INPUT', `sample has no reward; advantages need one on every sample`, { ...where, field: 'reward' });
    let e = episodeOf.get(s.episode);
    if (e === undefined) {
      episodeOf.set(s.episode, (e = rewards.length));
      rewards.push(s.reward);
      groups.push(s.group);
      tokens.push(0);
      firstOf.push(i);
    } else if (rewards[e] !== s.reward || groups[e] !== s.group) {
      throw new TreepackError(
        'E_INPUT',
        `episode ${JSON.stringify(s.episode)} has turns with different rewards or groups (${rewards[e]} in ${groups[e]}, ${s.reward} in ${s.group})`,
        {
          ...where,
          field: rewards[e] !== s.reward ? 'reward' : 'group',
        },
      );
    }
    for (let t = 0; t < s.loss_mask.length; t++) tokens[e] += s.loss_mask[t] ? 1 : 0;
    which[i] = e;
  }
  const adv = advantagesOf(rewards, groups, opts, tokens, (e) => {
    const s = samples[firstOf[e]];
    return { file: s.source?.file, line: s.source?.line, record: s.id };
  });
  return Float64Array.from(which, (e) => adv[e]);
}

/**
 * Sets `advantage` on the samples that have a reward and no advantages of their own (what `treepack pack` does
 * when rewards are given). The samples must hold whole groups: a group's baseline needs all its episodes.
 */
export function fillAdvantages(samples: Sample[], opts: AdvantageOptions): void {
  const todo = samples.filter(needsAdvantage);
  if (todo.length === 0) return;
  // A group's baseline needs all its episodes: estimating over the ones that bring no advantage of their own
  // would silently use a partial group.
  const estimated = new Set(todo.map((s) => s.group));
  const given = samples.find((s) => estimated.has(s.group) && (s.advantage !== undefined || s.advantages !== undefined));
  if (given) {
    throw new TreepackError(
      'E_INPUT',
      `group ${JSON.stringify(given.group)} mixes samples with their own advantages and samples whose advantages would be estimated from rewards; give advantages for all of the group or none`,
      {
        file: given.source.file,
        line: given.source.line,
        record: given.id,
        field: given.advantages !== undefined ? 'advantages' : 'advantage',
      },
    );
  }
  const adv = sampleAdvantages(todo, opts);
  todo.forEach((s, i) => (s.advantage = adv[i]));
}

/** A sample whose advantage `fillAdvantages` estimates: it has a reward and brings no advantages of its own. */
export function needsAdvantage(s: Sample): boolean {
  return s.reward !== undefined && s.advantage === undefined && s.advantages === undefined;
}
