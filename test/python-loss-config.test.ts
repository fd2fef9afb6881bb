/**
 * The Python loss config (python/treepack/loss.py make_config, behind PackedLoss and loss_numpy, and the typed
 * LossConfig dataclass) accepts and refuses exactly what src/loss/config.ts does, naming the same field, and fills
 * the same defaults.
 */
import { describe, expect, it } from 'vitest';
import { resolveLossConfig } from '../src/loss/config.js';
import { TreepackError } from '../src/errors.js';
import { pythonFor } from './helpers/python.js';
import { rng } from './helpers/sequences.js';

const py = pythonFor('test/python-loss-config.test.ts', 'numpy');

const VALUES: Record<string, unknown[]> = {
  policy: ['ppo', 'gspo', 'cispo', 'PPO', 1, null],
  clip_low: [0, 0.2, -0.1, NaN, Infinity, '0.2', true],
  clip_high: [0, 0.28, -1, null],
  dual_clip: [0, 1, 1.5, 3, -3, 0.5],
  log_ratio_clamp: [20, 0, -1, 0.5, Infinity],
  aggregation: [
    'token-mean',
    'seq-mean-token-sum',
    'seq-mean-token-mean',
    'seq-mean-token-sum-norm',
    'seq-mean-turn-mean-token-mean',
    'mean',
  ],
  norm_constant: [0, 3, -2],
  global_tokens: [0, 100, -1],
  global_sequences: [0, 10, -5],
  loss_scale: [1, 8, 0, -1, NaN],
  kl: ['none', 'k1', 'abs', 'k2', 'k3', 'k4'],
  kl_coef: [0, 0.1, -0.5, NaN],
  tis: ['none', 'token', 'sequence', 'seq'],
  tis_cap: [2, 0, -1, 0.5],
  clip_lo: [0.2],
};

function cases(): Record<string, unknown>[] {
  const out: Record<string, unknown>[] = [{}];
  for (const [k, vs] of Object.entries(VALUES)) for (const v of vs) out.push({ [k]: v });
  const r = rng(5);
  const keys = Object.keys(VALUES).filter((k) => k !== 'clip_lo');
  for (let i = 0; i < 300; i++) {
    const c: Record<string, unknown> = {};
    for (const k of keys) if (r() < 0.4) c[k] = VALUES[k][Math.floor(r() * VALUES[k].length)];
    out.push(c);
  }
  return out;
}

describe.skipIf(py.skipReason !== '')('python loss config', () => {
  it('accepts, refuses and fills exactly as resolveLossConfig', { timeout: 60_000 }, () => {
    const all = cases();
    const ts = all.map((c) => {
      try {
        return { ok: resolveLossConfig(c) as unknown as Record<string, unknown> };
      } catch (e) {
        if (!(e instanceof TreepackError)) throw e;
        return { field: e.where.field };
      }
    });
    const enc = JSON.stringify(all, (_k, v) => (typeof v === 'number' && !Number.isFinite(v) ? { $num: String(v) } : v));
    const script = `
import json, sys
from treepack import TreepackError
from treepack.loss import LossConfig, make_config, POLICIES, AGGREGATIONS, KL_ESTIMATORS, TIS_LEVELS
tables = {"policy": POLICIES, "aggregation": AGGREGATIONS, "kl": KL_ESTIMATORS, "tis": TIS_LEVELS}
def answer(build):
    try:
        cfg = make_config(build())
        return {"ok": {n: (tables[n][getattr(cfg, n)] if n in tables else getattr(cfg, n)) for n, _ in cfg._fields_}}
    except TreepackError as e:
        return {"field": e.field}
out = []
for c in json.loads(sys.stdin.read(), object_hook=lambda d: float(d["$num"].replace("Infinity", "inf")) if "$num" in d else d):
    # The dataclass takes known names only (Python refuses others), and None as its "not given" clip_high.
    typed = None if "clip_lo" in c or c.get("clip_high", 0) is None else answer(lambda: LossConfig(**c))
    out.append({"dict": answer(lambda: c), "typed": typed})
print(json.dumps(out))
`;
    const res = py.run(['-c', script], { input: enc });
    expect(res.status, res.stderr).toBe(0);
    const got = JSON.parse(res.stdout) as { dict: (typeof ts)[number]; typed: (typeof ts)[number] | null }[];
    expect(got.length).toBe(ts.length);
    let refused = 0;
    let typed = 0;
    for (let i = 0; i < ts.length; i++) {
      if (ts[i].field !== undefined) refused++;
      expect({ config: all[i], ...got[i].dict }).toEqual({ config: all[i], ...ts[i] });
      if (got[i].typed === null) continue;
      typed++;
      expect({ config: all[i], typed: true, ...got[i].typed }).toEqual({ config: all[i], typed: true, ...ts[i] });
    }
    expect(typed).toBeGreaterThan(ts.length / 2);
    expect(refused).toBeGreaterThan(50);
    expect(ts.length - refused).toBeGreaterThan(30);
  });
});
