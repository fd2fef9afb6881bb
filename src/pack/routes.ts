/**
 * Routing replay on a prefix forest: one route per node, exactly. An MoE engine routes a token every time it reads
 * it, so a token shared by two sequences (generated in one call, re-read as prompt in the next; or two calls of one
 * prompt) may carry two routes. Under the `split` policy a node is a token *and* its route: where the routes of a
 * shared prefix differ the forest branches there, and every sequence replays exactly the routes it was given.
 *
 * It is done by keying, so every backend, the micro-batch planner and step plans see the split alike: each
 * occurrence gets a class c, the rank of its route among the distinct routes at its node of the token-only forest
 * (0 where they agree), and the sequences of keys rank(token, c) are packed instead of the tokens; keys sort as
 * (token, route), so siblings stay in ascending token order and the layout depends only on the multiset of
 * (token, route) sequences. The keys are mapped back to tokens in the micro-batch. An unrouted occurrence (−1, e.g.
 * vLLM's last token) is a route like any other: the trainer routes it by the router's own top-k, as the unpacked
 * sequence would. `first` shares by tokens alone and gives each node its first sequence's routes (counted).
 */
import { TreepackError } from '../errors.js';
import type { Routes, Sample } from '../records/types.js';
import type { Forest, Sequences } from './contract.js';
import { packForest } from './forest.js';

/** Where the routes of a shared prefix differ: `split` the forest there (exact), or keep the `first` sequence's. */
export type RouteConflictPolicy = 'split' | 'first';
/** Every RouteConflictPolicy, the default first. */
export const ROUTE_CONFLICT_POLICIES: readonly RouteConflictPolicy[] = ['split', 'first'];

/** What keying by routes cost, accumulated over micro-batches. */
export interface RouteStats {
  /** occurrences whose route differs from the first occurrence's at their node of the token-only forest */
  conflicts: number;
  /** packed tokens of the same micro-batches sharing by tokens alone (the forest without the split), padding excluded */
  unsplitTokens: number;
  /** packed tokens of the micro-batches as packed, padding excluded */
  splitTokens: number;
}

/** The sequences to pack for routed samples, and how to turn their forest back into tokens and node routes. */
export interface RouteKeying {
  /** what the planner and the forest builder see: the tokens, or route keys where routes split a node */
  seqs: Sequences;
  /** key → token; absent when the keys are the tokens */
  tokenOf?: Int32Array;
  /** the forest of `seqs` when keying built it (routes present, keys = tokens): the caller need not build it again */
  forest?: Forest;
  /** the samples' common shape; absent when no sample has routes */
  layers?: number;
  topK?: number;
  conflicts: number;
  /** packed tokens of the token-only forest (the forest's size when no sample has routes: not computed, 0) */
  unsplitTokens: number;
}

/** The samples' routes, all of one shape, or none; a mix is refused (a sequence without routes would train unreplayed). */
function routeShape(samples: readonly Sample[]): { layers: number; topK: number } | undefined {
  const first = samples.find((s) => s.routes !== undefined);
  if (!first) return undefined;
  const { layers, topK } = first.routes!;
  for (const s of samples) {
    const where = { file: s.source.file, line: s.source.line, record: s.id, field: 'routes' };
    if (!s.routes)
      throw new TreepackError(
        'E_INPUT',
        `sample ${JSON.stringify(first.id)} has routes but this one has none; routes are replayed for every sequence of a micro-batch or none`,
        where,
      );
    if (s.routes.layers !== layers || s.routes.topK !== topK)
      throw new TreepackError(
        'E_INPUT',
        `routes of ${s.routes.layers} layers × top-${s.routes.topK}, but sample ${JSON.stringify(first.id)} has ${layers} × top-${topK}`,
        where,
      );
    if (s.routes.experts.length !== s.tokens.length * layers * topK)
      throw new TreepackError('E_INPUT', `routes hold ${s.routes.experts.length} experts for ${s.tokens.length} tokens`, where);
  }
  return { layers, topK };
}

/** Byte views of each sample's routes, for memcmp-speed row comparisons. */
function routeBytes(samples: readonly Sample[]): Buffer[] {
  return samples.map((s) => {
    const e = (s.routes as Routes).experts;
    return Buffer.from(e.buffer, e.byteOffset, e.byteLength);
  });
}

/**
 * The sequences to pack for `samples` (`seqs`, their tokens in CSR form) under `policy`. Without routes, or with
 * no conflict, the keys are the tokens themselves. `pack` builds the token-only forest (default the js reference;
 * the packer passes its backend's kernel).
 */
export function keyByRoutes(
  samples: readonly Sample[],
  seqs: Sequences,
  policy: RouteConflictPolicy,
  pack: (seqs: Sequences) => Forest = packForest,
): RouteKeying {
  const shape = routeShape(samples);
  if (!shape) return { seqs, conflicts: 0, unsplitTokens: 0 };
  const { tokens, offsets } = seqs;
  const M = tokens.length;
  const rowBytes = 2 * shape.layers * shape.topK;
  const bytes = routeBytes(samples);
  const sampleOf = new Int32Array(M);
  for (let i = 0; i < samples.length; i++) sampleOf.fill(i, offsets[i], offsets[i + 1]);
  // compare(o, q): the routes of occurrences o and q, as int16 rows compared bytewise (any fixed order will do)
  const compare = (o: number, q: number): number => {
    const a = sampleOf[o],
      b = sampleOf[q];
    const ao = (o - offsets[a]) * rowBytes,
      bo = (q - offsets[b]) * rowBytes;
    return bytes[a].compare(bytes[b], bo, bo + rowBytes, ao, ao + rowBytes);
  };
  const plain = pack(seqs);
  const pos = plain.seq_positions;
  const N = plain.input_ids.length;
  const first = new Int32Array(N).fill(-1);
  const conflicted = new Uint8Array(N);
  let conflicts = 0;
  for (let o = 0; o < M; o++) {
    const p = pos[o];
    if (first[p] < 0) first[p] = o;
    else if (compare(o, first[p]) !== 0) {
      conflicted[p] = 1;
      conflicts++;
    }
  }
  const base = { ...shape, conflicts, unsplitTokens: N };
  if (conflicts === 0 || policy === 'first') return { seqs, forest: plain, ...base };

  // The class of each occurrence at a conflicted node: the rank of its route among that node's distinct routes.
  const cls = new Int32Array(M);
  const members: number[] = [];
  for (let o = 0; o < M; o++) if (conflicted[pos[o]]) members.push(o);
  members.sort((o, q) => pos[o] - pos[q] || compare(o, q));
  for (let j = 1; j < members.length; j++) {
    const o = members[j],
      q = members[j - 1];
    if (pos[o] === pos[q]) cls[o] = compare(o, q) === 0 ? cls[q] : cls[q] + 1;
  }
  // key(token, c) = start[token] + c: ascending in (token, c), dense over the classes each token has.
  const maxClass = new Map<number, number>();
  for (let o = 0; o < M; o++) maxClass.set(tokens[o], Math.max(maxClass.get(tokens[o]) ?? 0, cls[o]));
  const distinct = Int32Array.from(maxClass.keys()).sort();
  const start = new Map<number, number>();
  let K = 0;
  for (const t of distinct) {
    start.set(t, K);
    K += maxClass.get(t)! + 1;
  }
  const tokenOf = new Int32Array(K);
  for (const t of distinct) {
    const from = start.get(t)!;
    tokenOf.fill(t, from, from + maxClass.get(t)! + 1);
  }
  const keys = new Int32Array(M);
  for (let o = 0; o < M; o++) keys[o] = start.get(tokens[o])! + cls[o];
  return { seqs: { tokens: keys, offsets }, tokenOf, ...base };
}

/**
 * The routes of each node of a forest of `samples` (its `seq_positions`, N nodes): int16 [N, layers, k], each
 * node the routes of its first occurrence in input order (all its occurrences' under `split`), −1 where none.
 */
export function nodeRoutes(samples: readonly Sample[], seqPositions: Int32Array, N: number, layers: number, topK: number): Int16Array {
  const R = layers * topK;
  const out = new Int16Array(N * R).fill(-1);
  const set = new Uint8Array(N);
  let o = 0;
  for (const s of samples) {
    const e = (s.routes as Routes).experts;
    for (let t = 0; t < s.tokens.length; t++, o++) {
      const p = seqPositions[o];
      if (set[p]) continue;
      set[p] = 1;
      out.set(e.subarray(t * R, (t + 1) * R), p * R);
    }
  }
  return out;
}
