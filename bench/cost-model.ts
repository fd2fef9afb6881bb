/**
 * Cost model of a training step (forward + backward) from a layout's work figures: FLOPs of the linear part
 * (projections and MLP per token, LM head per scored row), FLOPs of attention (exact: visible query/key pairs;
 * executed: listed B×B tiles, partial tiles computed whole), and bytes (weights and gradients per micro-batch,
 * saved activations per token). Step time = linear FLOPs ÷ R_lin + executed attention FLOPs ÷ R_attn + micro-batches ×
 * c₀ (+ bytes ÷ bandwidth on a GPU), with the rates fitted to this machine's measurements (leave-one-workload-out,
 * so every printed error is a prediction of data the fit never saw) or assumed for a GPU (labelled as such).
 */
import { readFileSync } from 'node:fs';

export interface ModelShape {
  name: string;
  hidden: number;
  intermediate: number;
  layers: number;
  heads: number;
  kv_heads: number;
  head_dim: number;
  vocab?: number;
  /** 'qwen3_5': `linear_layers` of the `layers` are Gated DeltaNet (the others attention), with these heads */
  family?: 'qwen3' | 'qwen3_5';
  linear_layers?: number;
  linear_key_heads?: number;
  linear_value_heads?: number;
  linear_head_dim?: number;
}

/** Work figures of one layout of a workload (bench/step.py `figures`). */
export interface SideFigures {
  micro_batches: number;
  tokens: number;
  occurrences: number;
  trainable: number;
  pairs: number;
  blocks: number;
  full_blocks: number;
  /** tiles the side's attention visits: the listed ones on flex, with the block path's padding on CPU, each sequence's
   * causal tiles on a stock path (older runs: absent) */
  executed_blocks?: number;
  /** B×B tiles a causal kernel visits running each sequence alone (older runs: absent) */
  causal_tiles?: number;
  scored_rows: number;
  max_tokens: number;
  /** recurrent layers (bench/step.py `figures`; older runs: absent): sequential depth levels summed over the
   * micro-batches, batched calls of one layer, and the tokens those calls hold with their padding */
  levels?: number;
  recurrent_calls?: number;
  recurrent_padded?: number;
}

export interface Work {
  linearFlops: number;
  attentionFlops: number; // exact: visible pairs only
  executedAttentionFlops: number; // listed tiles × B²
  bytes: number;
  microBatches: number;
}

/** Qwen3-4B (config.json of the released checkpoint): the second model the step bench trains on CUDA hosts. */
export const QWEN3_4B: ModelShape = {
  name: 'Qwen3-4B',
  hidden: 2560,
  intermediate: 9728,
  layers: 36,
  heads: 32,
  kv_heads: 8,
  head_dim: 128,
  vocab: 151936,
};

/** Qwen3 family shapes (config.json of the released checkpoints): the sizes the cost model estimates. */
export const QWEN3_SHAPES: ModelShape[] = [
  { name: 'Qwen3-0.6B', hidden: 1024, intermediate: 3072, layers: 28, heads: 16, kv_heads: 8, head_dim: 128, vocab: 151936 },
  { name: 'Qwen3-8B', hidden: 4096, intermediate: 12288, layers: 36, heads: 32, kv_heads: 8, head_dim: 128, vocab: 151936 },
  { name: 'Qwen3-32B', hidden: 5120, intermediate: 25600, layers: 64, heads: 64, kv_heads: 8, head_dim: 128, vocab: 151936 },
];

const FWD_BWD = 3; // backward ≈ 2 × forward for matmuls and attention

export function layerParams(s: ModelShape): number {
  const q = s.heads * s.head_dim,
    kv = s.kv_heads * s.head_dim;
  return s.hidden * q + 2 * s.hidden * kv + q * s.hidden + 3 * s.hidden * s.intermediate;
}

/** A Gated DeltaNet layer's weights: q, k, v, z, b, a and out projections, the MLP. */
function linearLayerParams(s: ModelShape): number {
  const k = (s.linear_key_heads ?? 0) * (s.linear_head_dim ?? 0),
    v = (s.linear_value_heads ?? 0) * (s.linear_head_dim ?? 0);
  return s.hidden * (2 * k + 2 * v + 2 * (s.linear_value_heads ?? 0)) + v * s.hidden + 3 * s.hidden * s.intermediate;
}

/** FLOPs per token of one Gated DeltaNet layer's chunked recurrence (64-token chunks, per value head: the state's
 * read and update, d² each, and the intra-chunk products, 64·d each), forward. O(tokens): its ideal ratio is the
 * token compression. */
function recurrenceFlops(s: ModelShape): number {
  const d = s.linear_head_dim ?? 0;
  return 2 * (s.linear_value_heads ?? 0) * (3 * d * d + 2 * 64 * d);
}

export function work(f: SideFigures, s: ModelShape, vocab: number, blockSize: number, dtypeBytes: number): Work {
  const linear = s.linear_layers ?? 0,
    attention = s.layers - linear;
  const perPair = 4 * s.heads * s.head_dim * attention * FWD_BWD; // QKᵀ and PV, multiply-add = 2 FLOPs each
  const perToken = 2 * (layerParams(s) * attention + linearLayerParams(s) * linear) + recurrenceFlops(s) * linear;
  const params = layerParams(s) * attention + linearLayerParams(s) * linear + vocab * s.hidden;
  // Saved activations per token and layer (q, k, v, attention out, MLP in/gate/up/act), written forward, read back.
  const activation = 2 * (4 * s.hidden + 3 * s.intermediate) * s.layers * dtypeBytes;
  return {
    linearFlops: (perToken * f.tokens + 2 * s.hidden * vocab * f.scored_rows) * FWD_BWD,
    attentionFlops: f.pairs * perPair,
    executedAttentionFlops: (f.executed_blocks ?? f.blocks) * blockSize * blockSize * perPair,
    bytes: f.micro_batches * params * dtypeBytes * 3 + f.tokens * activation,
    microBatches: f.micro_batches,
  };
}

/** Model FLOPs of a step (forward + backward = 3 × forward), attention at its useful (visible) pairs. */
export const totalFlops = (w: Work) => w.linearFlops + w.attentionFlops;

/** FLOPs of a step at the granularity the attention kernel works at: attention at the B×B tiles it visits, each
 * computed whole (the tile-level ideal's measure). */
export const tileFlops = (w: Work) => w.linearFlops + w.executedAttentionFlops;

/** Dense bf16/fp16 tensor-core peaks by device name (bench/device-peaks.json, which gpu-check reads too). */
type PeakEntry = { match: string; name: string; flops: number };
const peakTable = JSON.parse(readFileSync(new URL('./device-peaks.json', import.meta.url), 'utf8')) as { peaks: PeakEntry[] };
export const DEVICE_PEAKS: { match: RegExp; name: string; flops: number }[] = peakTable.peaks.map((p) => ({
  match: new RegExp(p.match, 'i'),
  name: p.name,
  flops: p.flops,
}));

/** The peak FLOP/s an MFU divides by, or why there is none: a CPU has no honest peak (its vector units' peak
 * depends on the ISA, clocks and threads), an unlisted GPU or a dtype other than bf16/fp16 has none in the table. */
export function devicePeak(device: string, deviceType: string, dtype: string): { name: string; flops: number } | { reason: string } {
  if (deviceType !== 'cuda') return { reason: 'no honest peak FLOP/s for a CPU: achieved FLOP/s instead' };
  if (dtype !== 'bfloat16' && dtype !== 'float16') return { reason: `no peak in the table for ${dtype} (bf16/fp16 dense only)` };
  const p = DEVICE_PEAKS.find((x) => x.match.test(device));
  return p ? { name: p.name, flops: p.flops } : { reason: `${device} is not in the peak table (bench/device-peaks.json)` };
}

/** Seconds per unit of linear FLOPs, executed attention FLOPs, micro-batches. */
export type Rates = [number, number, number];

const features = (w: Work): Rates => [w.linearFlops, w.executedAttentionFlops, w.microBatches];

export const predict = (w: Work, r: Rates) => features(w).reduce((a, x, i) => a + x * r[i], 0);

/** Least squares of relative error with non-negative coefficients (every active set of the 3 tried). */
export function fitRates(points: { work: Work; seconds: number }[]): Rates | null {
  let best: { rates: Rates; err: number } | null = null;
  for (let set = 1; set < 8; set++) {
    const idx = [0, 1, 2].filter((i) => set & (1 << i));
    const k = idx.length;
    const A = Array.from({ length: k }, () => new Float64Array(k)),
      b = new Float64Array(k);
    for (const p of points) {
      const x = idx.map((i) => features(p.work)[i] / p.seconds); // relative: divide the row by the target
      for (let i = 0; i < k; i++) {
        b[i] += x[i];
        for (let j = 0; j < k; j++) A[i][j] += x[i] * x[j];
      }
    }
    const sol = solve(A, b);
    if (!sol || sol.some((v) => !(v >= 0))) continue;
    const rates: Rates = [0, 0, 0];
    idx.forEach((i, j) => (rates[i] = sol[j]));
    const err = points.reduce((a, p) => a + (predict(p.work, rates) / p.seconds - 1) ** 2, 0);
    if (!best || err < best.err) best = { rates, err };
  }
  return best?.rates ?? null;
}

/** Gaussian elimination with partial pivoting; null when singular. */
function solve(A: Float64Array[], b: Float64Array): number[] | null {
  const n = b.length,
    M = A.map((row, i) => [...row, b[i]]);
  for (let c = 0; c < n; c++) {
    let p = c;
    for (let r = c + 1; r < n; r++) if (Math.abs(M[r][c]) > Math.abs(M[p][c])) p = r;
    if (Math.abs(M[p][c]) < 1e-300) return null;
    [M[c], M[p]] = [M[p], M[c]];
    for (let r = 0; r < n; r++) {
      if (r === c) continue;
      const f = M[r][c] / M[c][c];
      for (let j = c; j <= n; j++) M[r][j] -= f * M[c][j];
    }
  }
  return M.map((row, i) => row[n] / row[i]);
}

/**
 * An H100 SXM in bf16, assumed (not measured here): 989 TFLOP/s dense peak at 45% for the linear part, 35% for
 * FlexAttention's tiles, 3.35 TB/s at 70%, 5 ms of launches and optimizer-free overhead per micro-batch.
 */
export const ASSUMED_GPU = {
  name: 'H100 SXM, bf16 (assumed rates)',
  linear: 989e12 * 0.45,
  attention: 989e12 * 0.35,
  bandwidth: 3.35e12 * 0.7,
  perMicroBatch: 5e-3,
};

export function gpuSeconds(w: Work): number {
  const g = ASSUMED_GPU;
  return (
    Math.max(w.linearFlops / g.linear + w.executedAttentionFlops / g.attention, w.bytes / g.bandwidth) + w.microBatches * g.perMicroBatch
  );
}
