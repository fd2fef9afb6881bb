/**
 * Checks before any loss kernel runs, so every backend can assume well-formed input: shapes, the unmerge index in
 * range, the fields the config needs, finite values wherever a token is trainable (masked positions may hold
 * anything: they never enter the loss), loss_mask 0 or 1 and input_ids >= 0 (treepack never writes other values;
 * a trainer would count a mask of 7 as trainable and index its embedding at -1). Errors are TreepackError naming
 * the field, and the sequence and token.
 */
import { TreepackError } from '../errors.js';
import type { LossConfig } from './config.js';
import type { CompactPlan, LossBatch } from './types.js';

function fail(field: string, message: string): TreepackError {
  return new TreepackError('E_INPUT', message, { field });
}

/** The occurrence fields the config reads. */
function requiredFields(cfg: LossConfig): ('advantages' | 'old_logprobs' | 'ref_logprobs' | 'rollout_logprobs')[] {
  const f: ('advantages' | 'old_logprobs' | 'ref_logprobs' | 'rollout_logprobs')[] = ['advantages', 'old_logprobs'];
  if (cfg.kl !== 'none') f.push('ref_logprobs');
  if (cfg.tis !== 'none') f.push('rollout_logprobs');
  return f;
}

function checkLogprobs(lp: unknown, N: number): asserts lp is Float32Array {
  if (!(lp instanceof Float32Array))
    throw new TreepackError('E_ARG', `Expected a Float32Array for logprobs but received ${lp === null ? 'null' : typeof lp}`, {
      field: 'logprobs',
    });
  if (lp.length !== N)
    throw new TreepackError('E_ARG', `logprobs has ${lp.length} elements but the micro-batch has N = ${N} nodes`, { field: 'logprobs' });
}

/**
 * The checks every loss call runs before its kernel (computeLoss, resolveKernel('loss')), on their own: a caller
 * that receives micro-batches and logprobs from elsewhere can reject a bad one at its boundary, with the field and
 * position named, before a training step starts. `cfg` is a resolved config (resolveLossConfig).
 */
export function validateLossInputs(b: LossBatch, lp: unknown, cfg: LossConfig): asserts lp is Float32Array {
  const N = b.input_ids.length;
  checkLogprobs(lp, N);
  const { seq_offsets: off, seq_positions: pos, loss_mask: mask } = b;
  const M = pos.length;
  const S = off.length - 1;
  if (S < 0 || off[0] !== 0 || off[S] !== M) throw fail('seq_offsets', `seq_offsets must run from 0 to M = ${M}`);
  if (mask.length !== M) throw fail('loss_mask', `loss_mask has ${mask.length} elements but seq_positions has M = ${M}`);
  const fields = requiredFields(cfg);
  const arrays: Float32Array[] = [];
  for (const f of fields) {
    const a = b[f];
    if (!a) throw fail(f, `the loss config needs ${f} but the micro-batch has none`);
    if (a.length !== M) throw fail(f, `${f} has ${a.length} elements but seq_positions has M = ${M}`);
    arrays.push(a);
  }
  const ids = b.input_ids;
  for (let p = 0; p < N; p++) if (ids[p] < 0) throw fail('input_ids', `input_ids[${p}] = ${ids[p]} is not a token id (ids are ≥ 0)`);
  for (let i = 0; i < S; i++) {
    if (off[i + 1] < off[i]) throw fail('seq_offsets', `seq_offsets decreases at ${i + 1}`);
    for (let j = off[i]; j < off[i + 1]; j++) {
      const p = pos[j];
      if (!(p >= 0 && p < N)) throw fail('seq_positions', `seq_positions[${j}] = ${p} is outside [0, ${N})`);
      if (mask[j] > 1) throw fail('loss_mask', `loss_mask[${j}] = ${mask[j]} at sequence ${i} token ${j - off[i]}: expected 0 or 1`);
      if (!mask[j]) continue;
      // One sum catches NaN and ±inf in every field at once; the loop below only runs to name the culprit.
      let s = lp[p];
      for (const a of arrays) s += a[j] * 0;
      if (Number.isFinite(s)) continue;
      const where = `at sequence ${i} token ${j - off[i]} (a trainable position)`;
      if (!Number.isFinite(lp[p])) throw fail('logprobs', `logprobs[${p}] is ${lp[p]} ${where}`);
      for (let k = 0; k < fields.length; k++)
        if (!Number.isFinite(arrays[k][j])) throw fail(fields[k], `${fields[k]}[${j}] is ${arrays[k][j]} ${where}`);
    }
  }
  checkNormalisationInputs(b, cfg, fail);
}

/**
 * seq_weight [S] finite and ≥ 0; turn_ids [M], needed by the turn aggregation (when M > 0), never decreasing along a
 * sequence (a turn is a run of equal ids). Offsets are checked before this.
 */
function checkNormalisationInputs(
  b: Pick<LossBatch, 'seq_offsets' | 'seq_weight' | 'turn_ids'>,
  cfg: LossConfig,
  fail: (field: string, message: string) => Error,
): void {
  const off = b.seq_offsets;
  const S = off.length - 1;
  const sw = b.seq_weight;
  if (sw !== undefined) {
    if (!(sw instanceof Float32Array) || sw.length !== S)
      throw fail('seq_weight', `seq_weight must be a Float32Array with one weight per sequence (S = ${S})`);
    for (let i = 0; i < S; i++)
      if (!(sw[i] >= 0 && sw[i] < Infinity)) throw fail('seq_weight', `seq_weight[${i}] = ${sw[i]}: expected a finite number ≥ 0`);
  }
  if (cfg.aggregation !== 'seq-mean-turn-mean-token-mean') return;
  const t = b.turn_ids;
  if (!t && off[S] === 0) return; // nothing to aggregate
  if (!t)
    throw fail(
      'turn_ids',
      "aggregation 'seq-mean-turn-mean-token-mean' needs turn_ids but the micro-batch has none (treepack pack --turn-ids writes them)",
    );
  if (!(t instanceof Int32Array) || t.length !== off[S]) throw fail('turn_ids', `turn_ids must be an Int32Array of M = ${off[S]} elements`);
  for (let i = 0; i < S; i++) {
    for (let j = off[i] + 1; j < off[i + 1]; j++) {
      if (t[j] < t[j - 1])
        throw fail(
          'turn_ids',
          `turn_ids decreases at sequence ${i} token ${j - off[i]} (${t[j - 1]} then ${t[j]}): a turn is a run of equal ids`,
        );
    }
  }
}

export function validateCompactInputs(plan: CompactPlan, lp: unknown): asserts lp is Float32Array {
  checkLogprobs(lp, plan.num_nodes);
  for (let p = 0; p < plan.num_nodes; p++) {
    if (plan.n_train[p] > 0 && !Number.isFinite(lp[p]))
      throw fail('logprobs', `logprobs[${p}] is ${lp[p]} at a node with trainable occurrences`);
  }
}

export { fail as lossInputError };
