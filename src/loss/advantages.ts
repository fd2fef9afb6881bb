/**
 * Outcome advantages from scalar rewards, per group (GRPO family) and per batch (REINFORCE++ baseline), with
 * verl's conventions: unbiased std, ε in the denominator, a group of one has mean 0 and std 1.
 *
 * The unit is an episode (Flow-GRPO style): one reward per trajectory, and its advantage is broadcast to every
 * trainable token of every turn of that trajectory. Single-call data is the case of one-turn episodes.
 */
import { describeValue, TreepackError } from '../errors.js';
import type { Sample } from '../records/types.js';

export const ADVANTAGE_ESTIMATORS = ['grpo', 'dr-grpo', 'rloo', 'reinforce++-baseline'] as const;
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
 */
export function episodeAdvantages(rewards: ArrayLike<number>, groups: readonly string[], opts: AdvantageOptions, tokens?: ArrayLike<number>): Float64Array {
  const E = rewards.length;
  if (groups.length !== E) throw new TreepackError('E_ARG', `groups has ${groups.length} entries but rewards has ${E}`, { field: 'groups' });
  if (!(ADVANTAGE_ESTIMATORS as readonly string[]).includes(opts.estimator)) {
    throw new TreepackError('E_ARG', `Expected one of ${ADVANTAGE_ESTIMATORS.join(', ')} for estimator but received ${describeValue(opts.estimator)}`, { field: 'estimator' });
  }
  const eps = opts.epsilon ?? 1e-6;
  for (let e = 0; e < E; e++) {
    if (!Number.isFinite(rewards[e])) throw new TreepackError('E_INPUT', `reward of episode ${e} is ${rewards[e]}`, { field: 'reward' });
  }
  const { index, count } = groupIndex(groups);
  const n = new Float64Array(count);
  const sum = new Float64Array(count);
  for (let e = 0; e < E; e++) {
    n[index[e]]++;
    sum[index[e]] += rewards[e];
  }
  const mean = new Float64Array(count);
  const std = new Float64Array(count);
  for (let g = 0; g < count; g++) mean[g] = n[g] > 1 ? sum[g] / n[g] : 0;
  for (let e = 0; e < E; e++) std[index[e]] += (rewards[e] - mean[index[e]]) ** 2;
  for (let g = 0; g < count; g++) std[g] = n[g] > 1 ? Math.sqrt(std[g] / (n[g] - 1)) : 1;

  const out = new Float64Array(E);
  for (let e = 0; e < E; e++) {
    const g = index[e];
    const r = rewards[e];
    switch (opts.estimator) {
      case 'grpo':
        out[e] = (r - mean[g]) / (std[g] + eps);
        break;
      case 'dr-grpo':
      case 'reinforce++-baseline':
        out[e] = r - mean[g];
        break;
      case 'rloo':
        // r − mean of the others = (r − mean)·n/(n−1)
        out[e] = n[g] > 1 ? ((r - mean[g]) * n[g]) / (n[g] - 1) : r;
        break;
    }
  }
  if (opts.estimator === 'reinforce++-baseline') whiten(out, tokens);
  return out;
}

/** Token-weighted whitening over the batch (verl's masked_whiten: unbiased variance, 1e-8 under the root). */
function whiten(a: Float64Array, tokens?: ArrayLike<number>): void {
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
  const scale = 1 / Math.sqrt(variance + 1e-8);
  for (let e = 0; e < a.length; e++) a[e] = (a[e] - mean) * scale;
}

/**
 * Per-sample advantages for samples (turns) of episodes: episodes are keyed by `episode`, grouped by `group`, and
 * each takes its reward from its samples, which must agree. Returns one advantage per sample.
 */
export function sampleAdvantages(
  samples: readonly { id: string; group: string; episode: string; reward?: number; loss_mask: Uint8Array; source?: { file: string; line: number } }[],
  opts: AdvantageOptions,
): Float64Array {
  const episodeOf = new Map<string, number>();
  const rewards: number[] = [];
  const groups: string[] = [];
  const tokens: number[] = [];
  const which = new Int32Array(samples.length);
  for (let i = 0; i < samples.length; i++) {
    const s = samples[i];
    const where = { file: s.source?.file, line: s.source?.line, record: s.id };
    if (s.reward === undefined) throw new TreepackError('E_INPUT', `sample has no reward; advantages need one on every sample`, { ...where, field: 'reward' });
    let e = episodeOf.get(s.episode);
    if (e === undefined) {
      episodeOf.set(s.episode, (e = rewards.length));
      rewards.push(s.reward);
      groups.push(s.group);
      tokens.push(0);
    } else if (rewards[e] !== s.reward || groups[e] !== s.group) {
      throw new TreepackError('E_INPUT', `episode ${JSON.stringify(s.episode)} has turns with different rewards or groups (${rewards[e]} in ${groups[e]}, ${s.reward} in ${s.group})`, {
        ...where,
        field: rewards[e] !== s.reward ? 'reward' : 'group',
      });
    }
    for (let t = 0; t < s.loss_mask.length; t++) tokens[e] += s.loss_mask[t] ? 1 : 0;
    which[i] = e;
  }
  const adv = episodeAdvantages(rewards, groups, opts, tokens);
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
    throw new TreepackError('E_INPUT', `group ${JSON.stringify(given.group)} mixes samples with their own advantages and samples whose advantages would be estimated from rewards; give advantages for all of the group or none`, {
      file: given.source.file,
      line: given.source.line,
      record: given.id,
      field: given.advantages !== undefined ? 'advantages' : 'advantage',
    });
  }
  const adv = sampleAdvantages(todo, opts);
  todo.forEach((s, i) => (s.advantage = adv[i]));
}

/** A sample whose advantage `fillAdvantages` estimates: it has a reward and brings no advantages of its own. */
export function needsAdvantage(s: Sample): boolean {
  return s.reward !== undefined && s.advantage === undefined && s.advantages === undefined;
}
