/**
 * Host-side layout of the WebGPU loss: how a batch's trainable occurrences, its nodes and its sequences are cut into
 * chunks that each fit one storage binding, and what goes in each chunk. Pure typed-array code (no GPU), so the
 * chunk boundaries can be tested directly.
 *
 * Occurrence stream: the trainable occurrences stably sorted by node (sequence order within a node), so a node's
 * gradient is a sum over a contiguous run in a fixed order. A chunk is a run [o0, o1) of that stream and the node
 * range [n0, n1] it touches; a node whose run crosses a chunk boundary gets one partial gradient per chunk, summed on
 * the host in chunk order. Inside a chunk, each thread owns whole nodes with about occPerThread(T) occurrences.
 *
 * Sequence stream (GSPO only): (node, old) of the trainable occurrences in sequence order, cut every so many
 * occurrences; a sequence cut in two carries its running sum from one chunk's dispatch to the next.
 */
import { occurrenceWeights } from '../../loss/aggregate.js';
import type { LossConfig } from '../../loss/config.js';
import { truncatedWeight } from '../../loss/policy.js';
import type { CompactPlan, LossBatch } from '../../loss/types.js';

/**
 * Work items per thread: enough threads to fill a GPU (TARGET_THREADS), and beyond that as much work per thread as
 * allowed, which amortises the per-workgroup metric reduction (on the llvmpipe software adapter, 128 occurrences per
 * thread run about 1.5× faster than 32 at 1M occurrences).
 */
const TARGET_THREADS = 8192;
function perThread(items: number, min: number, max: number): number {
  return Math.min(max, Math.max(min, Math.ceil(items / TARGET_THREADS)));
}
export const occPerThread = (occurrences: number) => perThread(occurrences, 32, 256);
/** Compact mode: nodes per thread, strided by the workgroup size so that neighbouring threads read neighbouring nodes. */
export const compactPerThread = (nodes: number) => perThread(nodes, 4, 64);

/** Bytes per trainable occurrence in the occurrence stream's largest array (vec4: pg weight, advantage, old, KL weight). */
export const OCC_BYTES = 16;
/** Bytes per occurrence of the sequence stream (vec2: node, old). */
export const SEQ_OCC_BYTES = 8;
/** Bytes per node in each of the compact plan's two arrays (vec4). */
export const COMPACT_NODE_BYTES = 16;

export interface OccChunk {
  n0: number; // first node (global)
  n1: number; // last node, inclusive
  o0: number; // first occurrence of the node-sorted stream
  o1: number; // one past the last
}

/**
 * Cuts the node-sorted stream (node p's occurrences are [nodeOff[p], nodeOff[p+1])) into chunks of at most maxOcc
 * occurrences and maxNodes nodes. Chunks start at the node of their first occurrence (nodes with none before it are
 * skipped), end at a node boundary when the node limit binds, and may end mid-node when the occurrence limit does.
 */
export function planOccChunks(nodeOff: Uint32Array, maxOcc: number, maxNodes: number): OccChunk[] {
  const N = nodeOff.length - 1;
  const T = nodeOff[N];
  const chunks: OccChunk[] = [];
  let p = 0;
  let o = 0;
  while (o < T) {
    while (nodeOff[p + 1] <= o) p++;
    const n0 = p;
    const o0 = o;
    const oMax = o0 + maxOcc;
    let n1 = p;
    o = Math.min(nodeOff[p + 1], oMax);
    while (o === nodeOff[n1 + 1] && o < oMax && o < T && n1 + 2 - n0 <= maxNodes) {
      n1++;
      o = Math.min(nodeOff[n1 + 1], oMax);
    }
    chunks.push({ n0, n1, o0, o1: o });
  }
  return chunks;
}

/**
 * A chunk's index array: the local node offsets [L+1] (clipped to the chunk's occurrences), then the thread table
 * [threads+1] (first local node of each thread), greedily cut at perThread occurrences or perThread nodes (the node
 * bound caps a thread's walk over nodes with no occurrence).
 */
export function chunkIndex(nodeOff: Uint32Array, c: OccChunk, perThread: number): { index: Uint32Array; threads: number } {
  const L = c.n1 - c.n0 + 1;
  const local = new Uint32Array(L + 1);
  for (let q = 0; q <= L; q++) local[q] = Math.min(Math.max(nodeOff[c.n0 + q], c.o0), c.o1) - c.o0;
  const starts = [0];
  let occ = 0;
  let nodes = 0;
  for (let q = 0; q < L; q++) {
    occ += local[q + 1] - local[q];
    nodes++;
    if (q + 1 < L && (occ >= perThread || nodes >= perThread)) {
      starts.push(q + 1);
      occ = 0;
      nodes = 0;
    }
  }
  starts.push(L);
  const index = new Uint32Array(L + 1 + starts.length);
  index.set(local);
  index.set(starts, L + 1);
  return { index, threads: starts.length - 1 };
}

/** The node-sorted occurrence stream of a batch under a config (see the file comment), as counts and offsets only. */
export interface OccStream {
  /** Node p's occurrences are [nodeOff[p], nodeOff[p+1]) of the stream. */
  nodeOff: Uint32Array;
  /** Per occurrence [M]: the aggregation weight (aggregate.ts; 0 where not trainable). */
  weights: Float64Array;
  /** Per rank (a sequence's rank among non-empty sequences): the sequence-level truncated IS weight (1 unless tis = 'sequence'). */
  seqTis: Float64Array;
  /** Per rank: first position in the sequence-ordered stream of trainable occurrences ([G+1]), and the batch's sequence. */
  seqStart: Uint32Array;
  seqIndex: Int32Array;
}

export function occStream(b: LossBatch, cfg: LossConfig): OccStream {
  const { seq_offsets: off, seq_positions: pos, loss_mask: mask } = b;
  const S = off.length - 1;
  const N = b.input_ids.length;
  const { weights, counts } = occurrenceWeights(b, cfg);
  let G = 0;
  for (let i = 0; i < S; i++) if (counts[i] > 0) G++;
  const seqTis = new Float64Array(G).fill(1);
  const seqStart = new Uint32Array(G + 1);
  const seqIndex = new Int32Array(G);
  const nodeOff = new Uint32Array(N + 1);
  let g = 0;
  for (let i = 0; i < S; i++) {
    if (counts[i] === 0) continue;
    if (cfg.tis === 'sequence') {
      let s = 0;
      for (let j = off[i]; j < off[i + 1]; j++) if (mask[j]) s += b.old_logprobs![j] - b.rollout_logprobs![j];
      seqTis[g] = truncatedWeight(s, cfg.log_ratio_clamp, cfg.tis_cap);
    }
    for (let j = off[i]; j < off[i + 1]; j++) if (mask[j]) nodeOff[pos[j] + 1]++;
    seqIndex[g] = i;
    seqStart[g + 1] = seqStart[g] + counts[i];
    g++;
  }
  for (let p = 0; p < N; p++) nodeOff[p + 1] += nodeOff[p];
  return { nodeOff, weights, seqTis, seqStart, seqIndex };
}

/** Where one chunk's occurrence arrays go (typically the mapped ranges of its upload buffers). */
export interface OccTarget {
  /** [4·n]: pg weight = aggregation × truncated IS weight, advantage, old, KL weight. */
  a: Float32Array;
  /** [2·n], when KL or GSPO needs it: ref, bitcast sequence rank. */
  b?: Float32Array;
}

/**
 * Writes every chunk's occurrence arrays in one pass over the batch in sequence order, scattering each trainable
 * occurrence to its place in the node-sorted stream (a counting sort over seq_positions: reads stay sequential, and
 * no index arrays or per-occurrence objects are built). Chunks are consecutive runs of the stream, so a node's
 * occurrences leave its first chunk only when that chunk ends mid-node.
 */
export function fillOccArrays(b: LossBatch, cfg: LossConfig, s: OccStream, chunks: OccChunk[], targets: OccTarget[]): void {
  const { seq_offsets: off, seq_positions: pos, loss_mask: mask } = b;
  const N = s.nodeOff.length - 1;
  const C = chunks.length;
  const o0 = new Uint32Array(C);
  const o1 = new Uint32Array(C);
  // The chunk holding each node's next occurrence; reverse order so that a node shared by two chunks starts in the first.
  const chunkOf = new Uint32Array(N);
  for (let c = C - 1; c >= 0; c--) {
    o0[c] = chunks[c].o0;
    o1[c] = chunks[c].o1;
    chunkOf.fill(c, chunks[c].n0, chunks[c].n1 + 1);
  }
  const fill = s.nodeOff.slice(0, N);
  const old = b.old_logprobs!;
  const adv = b.advantages!;
  const ref = cfg.kl !== 'none' ? b.ref_logprobs! : undefined;
  const roll = cfg.tis === 'token' ? b.rollout_logprobs! : undefined;
  const withB = targets.some((t) => t.b);
  const aOf = targets.map((t) => t.a);
  const bOf = targets.map((t) => t.b ?? t.a);
  const uOf = bOf.map((x) => new Uint32Array(x.buffer, x.byteOffset, x.length));
  // One chunk is the common case: its arrays stay in locals and no occurrence looks its chunk up.
  let a = aOf[0];
  let bf = bOf[0];
  let bu = uOf[0];
  for (let r = 0; r < s.seqIndex.length; r++) {
    const i = s.seqIndex[r];
    const tis = s.seqTis[r];
    for (let j = off[i]; j < off[i + 1]; j++) {
      if (!mask[j]) continue;
      const w = s.weights[j];
      const p = pos[j];
      let q = fill[p]++;
      if (C > 1) {
        let c = chunkOf[p];
        if (q >= o1[c]) {
          while (q >= o1[c]) c++;
          chunkOf[p] = c;
        }
        q -= o0[c];
        a = aOf[c];
        bf = bOf[c];
        bu = uOf[c];
      }
      a[4 * q] = w * (roll ? truncatedWeight(old[j] - roll[j], cfg.log_ratio_clamp, cfg.tis_cap) : tis);
      a[4 * q + 1] = adv[j];
      a[4 * q + 2] = old[j];
      a[4 * q + 3] = w;
      if (withB) {
        bf[2 * q] = ref ? ref[j] : 0;
        bu[2 * q + 1] = r;
      }
    }
  }
}

export interface SeqChunk {
  r0: number; // rank of the first sequence
  o0: number; // first position of the sequence-ordered stream
  o1: number;
  /** Trainable tokens of the first sequence when it began in an earlier chunk (its mean needs the total), else 0. */
  firstTotal: number;
  /** The last sequence continues in the next chunk: store its running sum, not its mean. */
  lastOpen: boolean;
  pairs: Float32Array; // [2·n]: bitcast node, old
  range: Uint32Array; // local sequence offsets [local sequences + 1]
}

/** The sequence stream for GSPO, cut every maxOcc occurrences (a sequence may span chunks). */
export function seqChunks(b: LossBatch, s: OccStream, maxOcc: number): SeqChunk[] {
  const { seq_offsets: off, seq_positions: pos, loss_mask: mask } = b;
  const old = b.old_logprobs!;
  const G = s.seqIndex.length;
  const T = s.seqStart[G];
  const chunks: SeqChunk[] = [];
  let r = 0;
  // The walk over the batch goes on across chunks: j is the next unread position of sequence rank rr.
  let rr = 0;
  let j = G ? off[s.seqIndex[0]] : 0;
  for (let o0 = 0; o0 < T; o0 += maxOcc) {
    const o1 = Math.min(T, o0 + maxOcc);
    while (s.seqStart[r + 1] <= o0) r++;
    let last = r;
    while (s.seqStart[last + 1] < o1) last++;
    const range = new Uint32Array(last - r + 2);
    for (let q = 0; q < range.length; q++) range[q] = Math.min(Math.max(s.seqStart[r + q], o0), o1) - o0;
    const pairs = new Float32Array(2 * (o1 - o0));
    const pu = new Uint32Array(pairs.buffer);
    for (let k = 0; k < o1 - o0;) {
      const i = s.seqIndex[rr];
      if (j >= off[i + 1]) {
        rr++;
        j = off[s.seqIndex[rr]];
        continue;
      }
      if (mask[j]) {
        pu[2 * k] = pos[j];
        pairs[2 * k + 1] = old[j];
        k++;
      }
      j++;
    }
    chunks.push({
      r0: r,
      o0,
      o1,
      firstTotal: o0 > s.seqStart[r] ? s.seqStart[r + 1] - s.seqStart[r] : 0,
      lastOpen: o1 < s.seqStart[last + 1],
      pairs,
      range,
    });
  }
  return chunks;
}

/**
 * The compact plan's nodes [n0, n0 + n) as two vec4 arrays: (old, ref, pos weight, neg weight), (bitcast KL weight,
 * n_train, n_pos, n_neg).
 */
export function compactArrays(plan: CompactPlan, n0: number, n: number): { a: Float32Array; b: Uint32Array } {
  const a = new Float32Array(4 * n);
  const b = new Uint32Array(4 * n);
  const klw = new Uint32Array(plan.kl_weight.buffer, plan.kl_weight.byteOffset, plan.kl_weight.length);
  for (let q = 0; q < n; q++) {
    const p = n0 + q;
    a[4 * q] = plan.old[p];
    a[4 * q + 1] = plan.ref[p];
    a[4 * q + 2] = plan.pos_weight[p];
    a[4 * q + 3] = plan.neg_weight[p];
    b[4 * q] = klw[p];
    b[4 * q + 1] = plan.n_train[p];
    b[4 * q + 2] = plan.n_pos[p];
    b[4 * q + 3] = plan.n_neg[p];
  }
  return { a, b };
}
