/**
 * The training-step section's figures and words: per workload the token compression, the ideal work ratio at useful
 * attention pairs and at the tiles each side's kernel visits, the measured step speedup side by side, each side's
 * MFU (achieved FLOP/s on a CPU), why the measurement falls short of the ideal (partial tiles, micro-batch overheads,
 * with numbers), the cost model's leave-one-workload-out prediction error, and its estimates for real Qwen3 sizes.
 * Returns the terminal table as text (printed, and shown in the HTML page).
 */
import {
  ASSUMED_GPU,
  devicePeak,
  fitRates,
  gpuSeconds,
  predict,
  QWEN3_SHAPES,
  tileFlops,
  totalFlops,
  work,
  type Rates,
  type Work,
} from './cost-model.js';
import { fmt, mib, speed } from './format.js';
import type { StepSection, StepWorkload } from './step.js';

const SIDES = ['naive', 'merged', 'packed'] as const;
type Side = (typeof SIDES)[number];

/** A step's model FLOPs (forward + backward), attention counted at its useful pairs and at the tiles it visits. */
export interface PairsAndTiles {
  pairs: number;
  tiles: number;
}

export interface StepAnalysis {
  name: string;
  compression: number; // naive ÷ packed tokens
  idealRatio: number; // naive ÷ packed FLOPs, this model, attention at useful (visible) pairs
  /** naive ÷ packed FLOPs with attention at the B×B tiles each side's kernel visits (tileFlops) */
  tileIdealRatio: number;
  /** the goal's ideal: the tile-level one on a GPU, the pair-level one on a CPU; goal met: speedup ≥ 0.8 × it, null
   * where the goal does not apply (a GPU workload whose packed micro-batches fall outside 8k–32k tokens) */
  goal: { ideal: 'tiles' | 'pairs'; ratio: number; met: boolean | null };
  speedup: number; // naive ÷ packed step seconds
  mergedSpeedup: number;
  calls: number; // LLM calls of the workload
  timelines: number; // after the timeline merge
  packSeconds: number;
  sides: Record<
    Side,
    {
      step: number;
      masks: number;
      forward: number;
      loss: number;
      backward: number;
      peak: number | null;
      tokens: number;
      maxTokens: number;
      microBatches: number;
      predicted?: number;
      executedOverExact: number;
      sameAsNaive?: boolean;
      pageFaults?: number;
      recurrentForward?: number;
      /** the attention the side ran; its step's model FLOPs, FLOP/s achieved, and MFU (absent without a device peak) */
      attention?: string;
    } & StepRates
  >;
  /** a hybrid model: its recurrent layers' forward, naive ÷ packed seconds, against the token compression (their ideal) */
  recurrent?: { speedup: number; levels: number; calls: number; paddedOverTokens: number };
  shortfall: string[];
  realSizes: { model: string; idealRatio: number; gpuSpeedup: number }[];
}

export interface StepSummary {
  header: string;
  rows: StepAnalysis[];
  /** the peak FLOP/s the MFU divides by, or why no MFU is reported */
  peak: { name: string; flops: number } | { reason: string };
  rates?: Rates;
  modelError?: { mean: number; max: number };
  lossMismatches: string[];
  text: string;
}

function works(w: StepWorkload, s: StepSection): Record<Side, Work> {
  const vocab = w.vocab ?? 1;
  return Object.fromEntries(
    SIDES.map((k) => [k, work(w.figures![k], w.shape ?? s.shape!, vocab, 128, s.dtype === 'float32' ? 4 : 2)]),
  ) as Record<Side, Work>;
}

/** Minor faults a timed step may take without comment (a 16k-token naive step on glibc's defaults takes ~10⁵). */
const FAULTS_NOTED = 1000;

/** The packed micro-batch sizes the GPU goal (step ≥ 0.8 × the tile-level ideal) is stated for. */
export const GOAL_TOKENS = [8192, 32768] as const;

export interface StepRates {
  flops: PairsAndTiles;
  achieved: PairsAndTiles;
  mfu?: PairsAndTiles;
}

/** A step's model FLOPs, FLOP/s and MFU (where the device has a peak). */
export function stepRates(w: Work, seconds: number, peak: StepSummary['peak']): StepRates {
  const flops = { pairs: totalFlops(w), tiles: tileFlops(w) };
  const achieved = { pairs: flops.pairs / seconds, tiles: flops.tiles / seconds };
  if (!('flops' in peak)) return { flops, achieved };
  return { flops, achieved, mfu: { pairs: achieved.pairs / peak.flops, tiles: achieved.tiles / peak.flops } };
}

export function analyzeStep(s: StepSection): StepSummary {
  const lines: string[] = [];
  const lossMismatches: string[] = [];
  const shapes = [...new Map([s.shape, ...s.workloads.map((w) => w.shape)].flatMap((sh) => (sh ? [[sh.name, sh] as const] : []))).values()];
  const models = shapes
    .map((sh) => {
      const linear = sh.linear_layers
        ? `, ${sh.linear_layers} of them Gated DeltaNet (${sh.linear_key_heads}/${sh.linear_value_heads} heads × ${sh.linear_head_dim})`
        : '';
      return `${sh.name} (hidden ${sh.hidden}, ${sh.layers} layers${linear}, ${sh.heads}/${sh.kv_heads} heads × ${sh.head_dim}, MLP ${sh.intermediate})`;
    })
    .join(' and ');
  const tree = s.packedAttention ?? (s.attention === 'flex' ? 'FlexAttention + BlockMask' : 'block-sparse SDPA');
  const header =
    `## training step: forward + backward + RL loss of a random-weight ${models} on ${s.device}, ${s.dtype}, ` +
    `packed attention ${tree} (B = 128), torch ${s.torch}; micro-batches ≤ ${s.maxTokens} tokens`;
  lines.push(header);
  if (s.allocator) lines.push(`  harness allocator: ${s.allocator}`);
  lines.push(
    '  naive: every LLM call its own sequence; merged: timelines after the merge, each its own sequence; packed: treepack micro-batches (prefix trees)',
  );
  const chains = s.naiveAttention ?? `${tree} (a run before the stock baseline: tree attention on the chains)`;
  lines.push(`  naive and merged attention: ${chains}`);
  const peak = devicePeak(s.device ?? '', s.deviceType ?? 'cpu', s.dtype ?? '');
  const tileGoal = s.deviceType === 'cuda';
  const peakWords =
    'flops' in peak ? `${peak.name} dense ${s.dtype} peak ${fmt(peak.flops / 1e12, 0)} TFLOP/s)` : `peak): not reported, ${peak.reason}`;
  const tilesWhose = tileGoal ? "the goal's ideal here" : "the packed block path's with its padding";
  lines.push(
    `  ideal work ratio: naive ÷ packed model FLOPs (3 × forward), attention at useful pairs, and at the 128×128 tiles ` +
      `each side's kernel visits (${tilesWhose}); MFU: model FLOPs ÷ (step seconds × ${peakWords}`,
  );
  lines.push(
    `  peak +: memory the side's largest micro-batch adds, forward + backward (an untimed pass; ${s.deviceType === 'cuda' ? "the CUDA allocator's peak" : 'peak RSS growth after freed memory went back to the OS'})`,
  );
  const done = s.workloads.filter((w) => w.sides && w.figures && !w.error);
  for (const w of s.workloads.filter((w) => w.error)) lines.push(`  ${w.name}: FAILED: ${w.error}`);
  for (const w of s.workloads.filter((w) => w.skipped)) {
    lines.push(
      `  ${w.name}: skipped: ${w.skipped} (${w.report.naiveTokens.toLocaleString('en')} naive → ${w.report.packedTokens.toLocaleString('en')} packed tokens, ${fmt(w.compression)}× compression)`,
    );
  }
  for (const w of done) {
    for (const [side, why] of Object.entries(w.mismatches ?? {}))
      lossMismatches.push(`${w.name}: ${side} disagrees with naive: ${why.join('; ')}`);
  }
  // Leave-one-workload-out: each workload's sides are predicted from rates fitted on the others only. A merged side
  // that is naive's (the merge joined no call) is not a measurement of its own: left out of the fit and the error.
  const all = done.map((w) => ({ w, works: works(w, s) }));
  const timed = (w: StepWorkload) => SIDES.filter((k) => !w.sides![k].same_as_naive);
  const points = (x: (typeof all)[number]) => timed(x.w).map((k) => ({ work: x.works[k], seconds: x.w.sides![k].step }));
  const predicted = new Map<StepWorkload, Partial<Record<Side, number>>>();
  // Rates are fitted per model (a hybrid's recurrent layers run at other rates than attention and projections).
  const model = (w: StepWorkload) => (w.shape ?? s.shape!).name;
  for (const { w } of all) {
    const rates = fitRates(all.filter((x) => x.w !== w && model(x.w) === model(w)).flatMap(points));
    if (rates) predicted.set(w, Object.fromEntries(timed(w).map((k) => [k, predict(all.find((x) => x.w === w)!.works[k], rates)])));
  }
  const rates = fitRates(all.flatMap(points)) ?? undefined;
  const errors: number[] = [];
  const rows: StepAnalysis[] = all.map(({ w, works: wk }) => {
    const f = w.figures!,
      m = w.sides!;
    const pred = predicted.get(w);
    const sides = Object.fromEntries(
      SIDES.map((k) => {
        const p = pred?.[k];
        if (p !== undefined) errors.push(Math.abs(p / m[k].step - 1));
        return [
          k,
          {
            step: m[k].step,
            masks: m[k].masks,
            forward: m[k].forward,
            loss: m[k].loss,
            backward: m[k].backward,
            peak: m[k].peak_bytes,
            tokens: f[k].tokens,
            maxTokens: f[k].max_tokens,
            microBatches: f[k].micro_batches,
            predicted: p,
            executedOverExact: ((f[k].executed_blocks ?? f[k].blocks) * 128 * 128) / Math.max(1, f[k].pairs),
            sameAsNaive: m[k].same_as_naive,
            pageFaults: m[k].page_faults,
            recurrentForward: m[k].recurrent_forward,
            attention: m[k].attention,
            ...stepRates(wk[k], m[k].step, peak),
          },
        ];
      }),
    ) as StepAnalysis['sides'];
    const speedup = m.naive.step / m.packed.step;
    const idealRatio = totalFlops(wk.naive) / totalFlops(wk.packed);
    const tileIdealRatio = tileFlops(wk.naive) / tileFlops(wk.packed);
    const ideal = tileGoal ? tileIdealRatio : idealRatio;
    const inRange = !tileGoal || (f.packed.max_tokens >= GOAL_TOKENS[0] && f.packed.max_tokens <= GOAL_TOKENS[1]);
    const goal: StepAnalysis['goal'] = { ideal: tileGoal ? 'tiles' : 'pairs', ratio: speedup / ideal, met: null };
    if (inRange) goal.met = speedup >= 0.8 * ideal;
    const shortfall: string[] = [];
    if (speedup < 0.8 * ideal) {
      // Against the pair-level ideal, partial and padded tiles are part of the shortfall; the tile-level one counts them.
      if (!tileGoal) {
        const over = (k: Side) => fmt(sides[k].executedOverExact);
        shortfall.push(
          `tile-level work ratio ${fmt(tileIdealRatio)} (partial and padded tiles: packed attention computes ` +
            `${over('packed')}× its visible pairs, naive ${over('naive')}×)`,
        );
      }
      if (rates) {
        const fixed = (k: Side) => wk[k].microBatches * rates[2];
        shortfall.push(
          `fixed cost per micro-batch ${fmt(rates[2] * 1e3, 1)} ms: ${fmt(fixed('packed'), 2)} s of the packed step's ${fmt(m.packed.step, 2)} s (${f.packed.micro_batches} micro-batches), ${fmt(fixed('naive'), 2)} s of naive's`,
        );
      }
      const over = m.packed.masks / m.packed.step;
      if (over > 0.05) shortfall.push(`mask construction ${fmt(100 * over, 0)}% of the packed step`);
    }
    const realSizes = QWEN3_SHAPES.map((shape) => {
      // On the GPU FlexAttention computes the packed side's listed tiles, without the CPU block path's padding; the
      // chain sides' stock kernels each sequence's causal tiles.
      const gpuTiles = (k: Side) => (k === 'packed' ? f[k].blocks : (f[k].causal_tiles ?? f[k].blocks));
      const r = Object.fromEntries(SIDES.map((k) => [k, work({ ...f[k], executed_blocks: gpuTiles(k) }, shape, shape.vocab!, 128, 2)]));
      return {
        model: shape.name,
        idealRatio: totalFlops(r.naive) / totalFlops(r.packed),
        gpuSpeedup: gpuSeconds(r.naive) / gpuSeconds(r.packed),
      };
    });
    const rn = m.naive.recurrent_forward,
      rp = m.packed.recurrent_forward;
    const recurrent =
      rn !== undefined && rp !== undefined && rp > 0
        ? {
            speedup: rn / rp,
            levels: f.packed.levels ?? 0,
            calls: f.packed.recurrent_calls ?? 0,
            paddedOverTokens: (f.packed.recurrent_padded ?? 0) / Math.max(1, f.packed.tokens),
          }
        : undefined;
    return {
      name: w.name,
      calls: w.report.timelines,
      timelines: w.report.samples,
      compression: f.naive.tokens / f.packed.tokens,
      idealRatio,
      tileIdealRatio,
      goal,
      speedup,
      mergedSpeedup: m.naive.step / m.merged.step,
      packSeconds: w.packSeconds,
      sides,
      shortfall,
      realSizes,
      recurrent,
    };
  });
  lines.push('  workload / side          mbs     tokens   step s  masks  fwd   loss  bwd    tok/s   peak +    model s (err)');
  for (const r of rows) {
    lines.push(`  ${r.name}`);
    for (const k of SIDES) {
      const x = r.sides[k];
      if (x.sameAsNaive) {
        lines.push(`    ${k.padEnd(21)} = naive: the merge joined no call (the same sequences; not timed again)`);
        continue;
      }
      const err =
        x.predicted === undefined
          ? ''
          : `${fmt(x.predicted, 2)} (${x.predicted >= x.step ? '+' : ''}${fmt(100 * (x.predicted / x.step - 1), 0)}%)`;
      lines.push(
        `    ${k.padEnd(21)} ${String(x.microBatches).padStart(4)} ${String(x.tokens).padStart(10)} ${fmt(x.step, 2).padStart(8)} ${fmt(x.masks, 2).padStart(5)} ${fmt(x.forward, 2).padStart(5)} ${fmt(x.loss, 2).padStart(5)} ${fmt(x.backward, 2).padStart(5)} ${String(Math.round(x.tokens / x.step)).padStart(8)} ${(x.peak === null ? 'n/a' : mib(x.peak)).padStart(9)}  ${err}`,
      );
    }
    const g = r.goal;
    const verdict =
      g.met === null
        ? `not stated: packed micro-batches of up to ${r.sides.packed.maxTokens} tokens, outside ${GOAL_TOKENS[0]}–${GOAL_TOKENS[1]}`
        : g.met
          ? 'met'
          : 'MISSED';
    const merged = r.sides.merged.sameAsNaive ? '= naive' : speed(r.sides.naive.step, r.sides.merged.step);
    lines.push(
      `    token compression ${fmt(r.compression)}×, ideal work ratio ${fmt(r.idealRatio)}× at useful pairs, ` +
        `${fmt(r.tileIdealRatio)}× at tiles visited; measured: packed ${speed(r.sides.naive.step, r.sides.packed.step)} than naive ` +
        `(merged ${merged}); speedup ÷ compression ${fmt(r.speedup / r.compression)}, ` +
        `÷ pair ideal ${fmt(r.speedup / r.idealRatio)}, ÷ tile ideal ${fmt(r.speedup / r.tileIdealRatio)}`,
    );
    const range = g.ideal === 'tiles' ? ` at ${GOAL_TOKENS[0] / 1024}k–${GOAL_TOKENS[1] / 1024}k-token micro-batches` : '';
    const level = g.ideal === 'tiles' ? 'tile-level' : 'pair-level';
    lines.push(`    step ${fmt(g.ratio)} × the ${level} ideal (goal ≥ 0.8${range}: ${verdict})`);
    const rate = (k: Side) => {
      const x = r.sides[k];
      if (x.mfu) return `${k} ${fmt(100 * x.mfu.pairs, 1)}% / ${fmt(100 * x.mfu.tiles, 1)}%`;
      return `${k} ${fmt(x.achieved.pairs / 1e9, 1)} / ${fmt(x.achieved.tiles / 1e9, 1)} GFLOP/s`;
    };
    const timedSides = SIDES.filter((k) => !r.sides[k].sameAsNaive);
    const what = 'flops' in peak ? 'MFU' : 'achieved';
    lines.push(`    ${what} (attention at useful pairs / at tiles visited): ${timedSides.map(rate).join(', ')}`);
    for (const why of r.shortfall) lines.push(`      short of the ideal: ${why}`);
    const rec = r.recurrent;
    if (rec) {
      lines.push(
        `    recurrent layers (forward): packed ${fmt(rec.speedup)}× faster than naive, token compression ${fmt(r.compression)}× (their ideal; ÷ ideal ${fmt(rec.speedup / r.compression)}); ` +
          `${rec.levels} sequential depth levels, ${rec.calls} batched calls per layer over ${r.sides.packed.microBatches} micro-batches, rows padded to ${fmt(rec.paddedOverTokens)}× the tokens`,
      );
    }
    if (s.deviceType === 'cuda' && r.compression >= 50)
      lines.push(`    GPU goal (≥ 40× step speedup at ≥ 50× compression): ${fmt(r.speedup)}×, ${r.speedup >= 40 ? 'met' : 'MISSED'}`);
    const faults = SIDES.filter((k) => !r.sides[k].sameAsNaive && (r.sides[k].pageFaults ?? 0) > FAULTS_NOTED);
    if (faults.length)
      lines.push(
        `    page faults in timed steps: ${faults.map((k) => `${k} ${r.sides[k].pageFaults}`).join(', ')} (the allocator gave memory back to the OS; these steps include faulting it in again)`,
      );
    lines.push(
      `    timeline merge (by tokens): ${r.calls} calls → ${r.timelines} timelines${r.calls === r.timelines ? ' (no call extends an earlier one token for token: the chat template re-renders earlier turns)' : ''}`,
    );
    lines.push(
      `    estimated (cost model, ${ASSUMED_GPU.name}): ${r.realSizes.map((x) => `${x.model} ideal ${fmt(x.idealRatio, 1)}×, step ${fmt(x.gpuSpeedup, 1)}× faster`).join('; ')}`,
    );
  }
  const modelError = errors.length ? { mean: errors.reduce((a, x) => a + x, 0) / errors.length, max: Math.max(...errors) } : undefined;
  if (rates)
    lines.push(
      `  cost model rates fitted on this run: linear ${rates[0] > 0 ? fmt(1 / rates[0] / 1e9, 1) : '∞'} GFLOP/s, attention tiles ${rates[1] > 0 ? fmt(1 / rates[1] / 1e9, 1) : '∞'} GFLOP/s, ${fmt(rates[2] * 1e3, 1)} ms per micro-batch`,
    );
  if (modelError)
    lines.push(
      `  cost model prediction error (leave-one-workload-out, ${errors.length} steps): mean ${fmt(100 * modelError.mean, 1)}%, max ${fmt(100 * modelError.max, 1)}% (goal ≤ 20%: ${modelError.max <= 0.2 ? 'met' : 'MISSED'})`,
    );
  else lines.push('  cost model: fewer than 2 workloads measured, no out-of-sample prediction error');
  for (const m of lossMismatches) lines.push(`  LOSS MISMATCH: ${m}`);
  if (!lossMismatches.length && rows.length)
    lines.push('  losses, trainable logprob sums and gradient norms of merged and packed equal naive on every workload (asserted)');
  return { header, rows, peak, rates, modelError, lossMismatches, text: lines.join('\n') };
}
