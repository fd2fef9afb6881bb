/**
 * The LossAddon interface (src/backend/loss-addon.ts) against the addon it declares: the interface is read from its
 * source with the TypeScript compiler, and the real CPU addon (native/napi/loss_binding.h, which the CUDA addon shares)
 * is called through it. Each entry point takes exactly the declared number of arguments; given every declared
 * argument, optional ones included, in the declared order, it computes the loss the JavaScript reference computes and
 * returns exactly the fields LossMetrics declares (src/loss/types.ts); an argument of another type in any position
 * is refused naming the parameter declared there; null is accepted exactly where the interface allows it. A parameter
 * renamed, added, dropped or moved on either side, or a metric on one side only, fails here. Skipped, with the
 * reason, where the CPU addon is not built.
 */
import { readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import ts from 'typescript';
import { describe, expect, it } from 'vitest';
import { configVector } from '../src/backend/abi.js';
import { loadNative } from '../src/backend/native.js';
import { TreepackError } from '../src/errors.js';
import { buildCompactPlan, resolveLossConfig, type LossConfig } from '../src/loss/index.js';
import { lossCompactReference, lossReference } from '../src/loss/reference.js';
import { caught } from './helpers/errors.js';
import { close, randomLossCase } from './helpers/loss.js';

interface Param {
  name: string;
  /** the declared type less `| null`, e.g. Float32Array */
  type: string;
  nullable: boolean;
}
interface Method {
  params: Param[];
  returns: string;
}

function source(rel: string): ts.SourceFile {
  const file = fileURLToPath(new URL(`../${rel}`, import.meta.url));
  return ts.createSourceFile(file, readFileSync(file, 'utf8'), ts.ScriptTarget.Latest, true);
}

function declaredInterface(rel: string, name: string): ts.InterfaceDeclaration {
  const found = source(rel).statements.find((s): s is ts.InterfaceDeclaration => ts.isInterfaceDeclaration(s) && s.name.text === name);
  if (!found) throw new Error(`${rel} declares no interface ${name}`);
  return found;
}

/** The methods of an interface: parameter names, types (null split off) and return types, as written. */
function declaredMethods(rel: string, name: string): Map<string, Method> {
  const out = new Map<string, Method>();
  for (const m of declaredInterface(rel, name).members) {
    if (!ts.isMethodSignature(m)) continue;
    const params = m.parameters.map((p) => {
      const parts = ts.isUnionTypeNode(p.type!) ? p.type.types.map((t) => t.getText()) : [p.type!.getText()];
      return { name: p.name.getText(), type: parts.filter((t) => t !== 'null').join(' | '), nullable: parts.includes('null') };
    });
    out.set(m.name.getText(), { params, returns: m.type!.getText() });
  }
  return out;
}

const declaredFields = (rel: string, name: string) => declaredInterface(rel, name).members.map((m) => m.name!.getText());

/** A typed array of another type than `type`, of the same length: what each position must refuse. */
function wrongType(type: string, like: ArrayLike<number>): ArrayLike<number> {
  const n = like.length;
  return type === 'Float32Array' ? new Int32Array(n) : type === 'Float64Array' ? new Float32Array(n) : new Float64Array(n);
}

const native = loadNative();
const skip = 'error' in native ? native.error : '';
if (skip) console.log(`loss addon interface tests skipped: ${skip}`);

const methods = declaredMethods('src/backend/loss-addon.ts', 'LossAddon');
const metricFields = declaredFields('src/loss/types.ts', 'LossMetrics');

describe.skipIf(skip !== '')(`LossAddon against the CPU addon${skip ? ` (skipped: ${skip})` : ''}`, () => {
  // By name, as the addon sees its entry points: the typed binding is what this test holds to account.
  const binding: object = (native as { binding: object }).binding;
  const addon = Object.fromEntries(
    Object.entries(Object.getOwnPropertyDescriptors(binding)).map(([k, d]) => [k, d.value as (...args: unknown[]) => unknown]),
  );
  const { batch, lp } = randomLossCase(
    [
      [1, 2, 3, 4],
      [1, 2, 5],
      [6, 7, 8],
    ],
    3,
    { sharedOld: true, maskRate: 0 },
  );
  const M = batch.seq_positions.length;
  // Two turns per sequence: the second from t = 2.
  const turns = new Int32Array(M);
  for (let i = 0; i + 1 < batch.seq_offsets.length; i++)
    for (let j = batch.seq_offsets[i] + 2; j < batch.seq_offsets[i + 1]; j++) turns[j] = 1;
  const full = { ...batch, seq_weight: Float32Array.from([0.5, 1, 2]), turn_ids: turns };
  // Every optional input read: a KL term (ref), TIS (rollout), per-turn aggregation (turn_ids), sequence weights.
  const lossCfg = resolveLossConfig({ kl: 'k3', kl_coef: 0.1, tis: 'token', aggregation: 'seq-mean-turn-mean-token-mean' });
  const compactCfg = resolveLossConfig({ kl: 'k3', kl_coef: 0.1 });
  const plan = buildCompactPlan(full, compactCfg);
  /** Each entry point's arguments by the name the addon gives them, and the reference result. */
  const calls: Record<string, { cfg: LossConfig; values: Record<string, unknown>; reference: () => ReturnType<typeof lossReference> }> = {
    loss: {
      cfg: lossCfg,
      values: {
        config: configVector(lossCfg),
        seq_offsets: full.seq_offsets,
        seq_positions: full.seq_positions,
        loss_mask: full.loss_mask,
        advantages: full.advantages,
        old_logprobs: full.old_logprobs,
        ref_logprobs: full.ref_logprobs,
        rollout_logprobs: full.rollout_logprobs,
        seq_weight: full.seq_weight,
        turn_ids: full.turn_ids,
        lp,
        grad: new Float32Array(lp.length),
      },
      reference: () => lossReference(full, lp, lossCfg),
    },
    lossCompact: {
      cfg: compactCfg,
      values: {
        config: configVector(compactCfg),
        lp,
        old: plan.old,
        ref: plan.ref,
        pos_weight: plan.pos_weight,
        neg_weight: plan.neg_weight,
        kl_weight: plan.kl_weight,
        n_train: plan.n_train,
        n_pos: plan.n_pos,
        n_neg: plan.n_neg,
        grad: new Float32Array(lp.length),
      },
      reference: () => lossCompactReference(plan, lp, compactCfg),
    },
  };
  /** The arguments in the interface's order, each fresh (grad is written). */
  const argsOf = (name: string, method: Method) =>
    method.params.map((p) => {
      const v = calls[name].values[p.name];
      if (v === undefined) throw new Error(`LossAddon.${name} declares ${p.name}, which the addon's ${name} does not take`);
      return p.name === 'grad' ? new Float32Array(lp.length) : v;
    });

  it('declares exactly the entry points the addon exports', () => {
    expect([...methods.keys()].sort()).toEqual(Object.keys(calls).sort());
    for (const name of methods.keys()) expect(typeof addon[name], name).toBe('function');
  });

  for (const [name, method] of methods) {
    describe(`LossAddon.${name}`, () => {
      it('takes every declared argument in the declared order and returns exactly the declared metrics', () => {
        expect(Object.keys(calls[name].values), 'the parameters the interface declares, in order').toEqual(
          method.params.map((p) => p.name),
        );
        expect(method.returns).toBe('LossMetrics');
        const args = argsOf(name, method);
        const metrics = addon[name](...args) as Record<string, unknown>;
        expect(Object.keys(metrics).sort()).toEqual([...metricFields].sort());
        const ref = calls[name].reference();
        for (const f of metricFields) {
          expect(typeof metrics[f], f).toBe('number');
          close(metrics[f] as number, (ref.metrics as unknown as Record<string, number>)[f], 1e-5, `${name} ${f}`);
        }
        expect(ref.metrics.trainable_tokens).toBeGreaterThan(0);
        // grad is an output: the gradient the reference computes, written in place.
        const grad = args[method.params.findIndex((p) => p.name === 'grad')] as Float32Array;
        grad.forEach((g, k) => close(g, ref.grad[k], 1e-4, `${name} grad[${k}]`));
        expect(grad.some((g) => g !== 0)).toBe(true);
      });

      it('takes exactly the declared number of arguments', () => {
        const args = argsOf(name, method);
        for (const wrong of [args.slice(0, -1), [...args, null]]) {
          const err = caught(() => addon[name](...wrong)) as TreepackError;
          expect(err, `${wrong.length} arguments`).toBeInstanceOf(TreepackError);
          expect(err.message).toMatch(new RegExp(`Expected ${method.params.length} arguments for ${name}`));
        }
      });

      it('refuses another type in each position, naming the parameter declared there', () => {
        method.params.forEach((p, k) => {
          const args = argsOf(name, method);
          args[k] = wrongType(p.type, args[k] as ArrayLike<number>);
          const err = caught(() => addon[name](...args)) as TreepackError;
          expect(err, p.name).toBeInstanceOf(TreepackError);
          expect(err.code, p.name).toBe('E_ARG');
          expect(err.message, `position ${k}`).toMatch(new RegExp(`Expected an? ${p.type}\\b.* for ${p.name}$`));
        });
      });

      it('accepts null exactly where the interface declares it', () => {
        // With nothing optional configured (no KL, no TIS, no per-turn aggregation), every nullable input may be null.
        const bare = resolveLossConfig({});
        method.params.forEach((p, k) => {
          const args = argsOf(name, method);
          args[0] = configVector(bare);
          args[k] = null;
          if (p.nullable) expect(() => addon[name](...args), p.name).not.toThrow();
          else expect((caught(() => addon[name](...args)) as Error).message, p.name).toMatch(new RegExp(` for ${p.name}$`));
        });
      });
    });
  }
});
