/**
 * Loss bench: occurrences per second per backend over generator forests of M naive tokens, the bytes the kernel
 * must move ÷ its time against a plain copy of as many bytes measured in the same run, and the compact per-node
 * mode against the per-occurrence one. The validation pass (validateLossInputs, run once per call by computeLoss) is
 * timed apart.
 * WebGPU lays a batch out and uploads it on its first call (cached per batch object and config, then each call only
 * moves lp and the gradient): that one-time cost is its `first-call` row; its other rows are the calls after it.
 */
import { performance } from 'node:perf_hooks';
import { buildCompactPlan, concatSequences, resolveLossConfig, validateLossInputs, type LossBatch } from '../src/index.js';
import { disposeBackends, listBackends, resolveKernel } from '../src/ops.js';
import { speed } from './format.js';
import { generateTokenSamples } from './dataset.js';

export interface LossBenchRow {
  M: number;
  N: number;
  backend: string;
  mode: 'per-occurrence' | 'compact' | 'first-call' | 'compact-first-call' | 'validate' | 'copy';
  seconds: number;
  occurrencesPerSecond: number;
  gbPerSecond: number;
}

/** A packed batch of about `target` naive tokens of generated agent rollouts; old/ref depend on the node only. */
async function forestBatch(target: number): Promise<{ batch: LossBatch; lp: Float32Array }> {
  const tokens: number[][] = [];
  let M = 0;
  for (let seed = 1; M < target; seed++) {
    for (const s of generateTokenSamples({ groups: 8, seed })) {
      if (M >= target) break;
      tokens.push(s.tokens);
      M += s.tokens.length;
    }
  }
  const { tokens: flat, offsets } = concatSequences(tokens);
  const forest = (await resolveKernel('packForest', 'auto')).kernel({ tokens: flat, offsets });
  const N = forest.input_ids.length;
  const nodeVal = (p: number, k: number) => Math.fround(-3 * (((Math.imul(p + 1, 2654435761) ^ k) >>> 0) / 4294967296));
  const lp = Float32Array.from({ length: N }, (_, p) => nodeVal(p, 1));
  const loss_mask = new Uint8Array(M);
  const advantages = new Float32Array(M);
  const old_logprobs = new Float32Array(M);
  const ref_logprobs = new Float32Array(M);
  for (let i = 0; i < tokens.length; i++) {
    const a = i % 3 === 0 ? -1 : 0.5;
    for (let j = offsets[i]; j < offsets[i + 1]; j++) {
      const p = forest.seq_positions[j];
      loss_mask[j] = j > offsets[i] && (j - offsets[i]) % 4 !== 0 ? 1 : 0;
      advantages[j] = a;
      old_logprobs[j] = nodeVal(p, 2);
      ref_logprobs[j] = nodeVal(p, 3);
    }
  }
  return { batch: { ...forest, loss_mask, advantages, old_logprobs, ref_logprobs }, lp };
}

async function once(fn: () => Promise<unknown>): Promise<number> {
  const t = performance.now();
  await fn();
  return (performance.now() - t) / 1000;
}

async function time(fn: () => unknown, minSeconds: number): Promise<number> {
  await fn();
  let runs = 0;
  const t0 = performance.now();
  let best = Infinity;
  while (runs < 3 || performance.now() - t0 < minSeconds * 1000) {
    const t = performance.now();
    await fn();
    best = Math.min(best, (performance.now() - t) / 1000);
    runs++;
    if (runs >= 50) break;
  }
  return best;
}

export async function benchLoss(opts: { quick: boolean }): Promise<LossBenchRow[]> {
  const sizes = opts.quick ? [1 << 20] : [1 << 20, 8 << 20, 32 << 20];
  const minSeconds = opts.quick ? 0.3 : 1;
  const cfg = resolveLossConfig({ clip_low: 0.2, clip_high: 0.28, dual_clip: 3, kl: 'k3', kl_coef: 0.01 });
  const status = await listBackends();
  const backends = status.filter((b) => b.available && b.ops.includes('loss')).map((b) => b.name);
  const rows: LossBenchRow[] = [];
  console.log(`\n## loss (ppo, dual clip, k3 KL, token-mean) over generated agent forests; best of repeated runs`);
  for (const target of sizes) {
    const { batch, lp } = await forestBatch(target);
    const M = batch.seq_positions.length;
    const N = lp.length;
    // What the per-occurrence kernel must touch: pos, mask, advantage, old, ref per occurrence; lp and grad per node.
    const bytes = M * (4 + 1 + 4 + 4 + 4) + N * 8;
    const compactBytes = N * (4 * 6 + 4 * 3 + 4 + 4);
    const src = new Uint8Array(bytes);
    const dst = new Uint8Array(bytes);
    const copy = await time(() => dst.set(src), minSeconds);
    const row = (backend: string, mode: LossBenchRow['mode'], seconds: number, moved: number): LossBenchRow => ({
      M,
      N,
      backend,
      mode,
      seconds,
      occurrencesPerSecond: M / seconds,
      gbPerSecond: moved / seconds / 1e9,
    });
    const add = (r: LossBenchRow) => {
      rows.push(r);
      const bw =
        r.mode === 'copy'
          ? 'baseline'
          : `${((100 * r.gbPerSecond) / rows.find((x) => x.M === M && x.mode === 'copy')!.gbPerSecond).toFixed(0)}% of copy bandwidth`;
      console.log(
        `  M ${(M / 1e6).toFixed(1)}M N ${(N / 1e6).toFixed(2)}M  ${r.backend.padEnd(7)} ${r.mode.padEnd(18)} ${(r.seconds * 1e3).toFixed(2).padStart(9)} ms  ${(r.occurrencesPerSecond / 1e6).toFixed(1).padStart(7)}M occ/s  ${r.gbPerSecond.toFixed(2).padStart(6)} GB/s (${bw})`,
      );
    };
    add(row('memcpy', 'copy', copy, bytes));
    add(row('ts', 'validate', await time(() => validateLossInputs(batch, lp, cfg), minSeconds), bytes));
    const plan = buildCompactPlan(batch, cfg);
    for (const b of backends) {
      const k = await resolveKernel('loss', b);
      const prepares = b === 'webgpu';
      try {
        if (prepares) add(row(b, 'first-call', await once(() => k.kernel({ ...batch }, lp, cfg)), bytes));
        add(row(b, 'per-occurrence', await time(() => k.kernel(batch, lp, cfg), b === 'js' ? minSeconds / 3 : minSeconds), bytes));
      } catch (err) {
        console.log(`  ${b}: skipped at M = ${M}: ${(err as Error).message}`);
        continue;
      }
      const c = status.find((s) => s.name === b)!.ops.includes('lossCompact') ? await resolveKernel('lossCompact', b) : undefined;
      if (!c) continue;
      if (prepares) add(row(b, 'compact-first-call', await once(() => c.kernel({ ...plan }, lp, cfg)), compactBytes));
      const r = row(b, 'compact', await time(() => c.kernel(plan, lp, cfg), minSeconds), compactBytes);
      add(r);
      const per = rows.find((x) => x.M === M && x.backend === b && x.mode === 'per-occurrence')!;
      console.log(`    compact mode on ${b}: ${speed(per.seconds, r.seconds)} than per-occurrence (M/N = ${(M / N).toFixed(2)})`);
    }
  }
  await disposeBackends();
  return rows;
}
