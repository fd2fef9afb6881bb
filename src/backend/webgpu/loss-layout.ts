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
import { countTrainable, sequenceWeight } from '../../loss/aggregate.js';
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

/** The node-sorted occurrence stream of a batch under a config (see the file comment). */
export interface OccStream {
  /** Node p's occurrences are [nodeOff[p], nodeOff[p+1]) of the stream. */
  nodeOff: Uint32Array;
  /** Per stream position: the occurrence's index in the batch, and its sequence's rank among non-empty sequences. */
  occ: Int32Array;
  rank: Int32Array;
  /** Per rank: aggregation weight and sequence-level truncated IS weight (1 unless tis = 'sequence'). */
  weight: Float64Array;
  seqTis: Float64Array;
  /** Per rank: first position in the sequence-ordered stream of trainable occurrences ([G+1]), and the batch's sequence. */
  seqStart: Uint32Array;
  seqIndex: Int32Array;
}

export function occStream(b: LossBatch, cfg: LossConfig): OccStream {
  const { seq_offsets: off, seq_positions: pos, loss_mask: mask } = b;
  const S = off.length - 1;
  const N = b.input_ids.length;
  const counts = new Int32Array(S);
  const norm = countTrainable(off, mask, cfg, counts);
  let G = 0;
  for (let i = 0; i < S; i++) if (counts[i] > 0) G++;
  const weight = new Float64Array(G);
  const seqTis = new Float64Array(G).fill(1);
  const seqStart = new Uint32Array(G + 1);
  const seqIndex = new Int32Array(G);
  const nodeOff = new Uint32Array(N + 1);
  let g = 0;
  for (let i = 0; i < S; i++) {
    if (counts[i] === 0) continue;
    weight[g] = sequenceWeight(cfg, counts[i], norm);
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
  const T = nodeOff[N];
  const occ = new Int32Array(T);
  const rank = new Int32Array(T);
  const fill = nodeOff.slice(0, N);
  for (let r = 0; r < G; r++) {
    const i = seqIndex[r];
    for (let j = off[i]; j < off[i + 1]; j++) {
      if (!mask[j]) continue;
      const k = fill[pos[j]]++;
      occ[k] = j;
      rank[k] = r;
    }
  }
  return { nodeOff, occ, rank, weight, seqTis, seqStart, seqIndex };
}

/**
 * The arrays of stream positions [o0, o1): a [4·n] (pg weight = aggregation × truncated IS weight, advantage, old,
 * KL weight) and, when KL or GSPO needs it, b [2·n] (ref, bitcast sequence rank).
 */
export function occArrays(b: LossBatch, cfg: LossConfig, s: OccStream, o0: number, o1: number, withB: boolean): { a: Float32Array; b?: Float32Array } {
  const n = o1 - o0;
  const a = new Float32Array(4 * n);
  const bb = withB ? new Float32Array(2 * n) : undefined;
  const bu = bb && new Uint32Array(bb.buffer);
  const old = b.old_logprobs!;
  const adv = b.advantages!;
  const ref = cfg.kl !== 'none' ? b.ref_logprobs! : undefined;
  const roll = cfg.tis === 'token' ? b.rollout_logprobs! : undefined;
  for (let k = 0; k < n; k++) {
    const j = s.occ[o0 + k];
    const r = s.rank[o0 + k];
    const w = s.weight[r];
    const tis = roll ? truncatedWeight(old[j] - roll[j], cfg.log_ratio_clamp, cfg.tis_cap) : s.seqTis[r];
    a[4 * k] = w * tis;
    a[4 * k + 1] = adv[j];
    a[4 * k + 2] = old[j];
    a[4 * k + 3] = w;
    if (bb) {
      bb[2 * k] = ref ? ref[j] : 0;
      bu![2 * k + 1] = r;
    }
  }
  return { a, b: bb };
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
    for (let k = 0; k < o1 - o0; ) {
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
    chunks.push({ r0: r, o0, o1, firstTotal: o0 > s.seqStart[r] ? s.seqStart[r + 1] - s.seqStart[r] : 0, lastOpen: o1 < s.seqStart[last + 1], pairs, range });
  }
  return chunks;
}

/** The compact plan's nodes [n0, n0 + n) as two vec4 arrays: (old, ref, pos weight, neg weight), (bitcast KL weight, n_train, n_pos, n_neg). */
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
