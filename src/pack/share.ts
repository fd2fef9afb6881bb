/**
 * Shared prefixes (docs/design.md §11): a cached chain that micro-batches of several data-parallel ranks hang from is
 * computed once per data-parallel group, in shares, instead of once per rank.
 *
 * The step plan's ranks run contiguous spans of the micro-batches in DFS order (prefix.ts), so the ranks that hold
 * a node of a chain form a contiguous range, and a node held by two ranks lies on the common chain of the last
 * micro-batch of one rank and the first of the next. The shared nodes are therefore the chains common across rank
 * boundaries; they split into *pieces* (a depth range of one root path held by one contiguous range of ranks),
 * further cut wherever any rank's chain leaves the piece's path (so every rank's stack holds a piece as one
 * segment) and every B tokens (a piece is recomputed with grad in shares, and its shares must fit the budget).
 * Each rank of a piece's group computes one contiguous range of it; the group exchanges the K/V (and states) so every
 * member holds the whole piece, and returns the gradients of each range to the rank that computed it.
 */
/** A chain a micro-batch hangs from: the root path of sorted sequence `rep` to depth `h`, on `rank`. */
export interface Chain {
  rep: number;
  h: number;
  rank: number;
}

/** A piece of a prefix computed in shares by a contiguous range of ranks. */
export interface SharedPiece {
  /** the root path of this sorted sequence holds it, at depths [start, end) */
  rep: number;
  start: number;
  end: number;
  /** the ranks holding it, ascending and contiguous */
  ranks: number[];
  /** per rank of `ranks`: the depth range [a, b) it computes; contiguous, together [start, end) */
  ranges: [number, number][];
}

/**
 * The shared pieces of chains listed in DFS order with ranks ascending along it (contiguous spans), pieces in
 * order of their path then depth (every piece after the pieces above it on its path). `lcpAt(a, b)` is the common
 * prefix of sorted sequences a and b (their length when a = b).
 */
export function sharedPieces(chains: readonly Chain[], lcpAt: (a: number, b: number) => number, B: number): SharedPiece[] {
  const common = (x: Chain, y: Chain) => Math.min(x.h, y.h, lcpAt(x.rep, y.rep));
  // One boundary per pair of consecutive busy ranks: the last chain of rank r against the first of rank r + 1.
  const bounds: { last: Chain; x: number; lo: number }[] = [];
  for (let m = 0; m + 1 < chains.length; m++) {
    if (chains[m].rank !== chains[m + 1].rank) bounds.push({ last: chains[m], x: common(chains[m], chains[m + 1]), lo: chains[m].rank });
  }
  // Depths [base, top) shared across boundaries p..q: their chains' common part, ranks lo(p) .. lo(q) + 1. The run
  // splits where a boundary's shared chain ends (x = top) or two neighbours' chains part (link = top).
  const link = (b: number) => Math.min(bounds[b].x, bounds[b + 1].x, lcpAt(bounds[b].last.rep, bounds[b + 1].last.rep));
  const raw: { rep: number; start: number; end: number; lo: number; hi: number }[] = [];
  const solve = (p: number, q: number, base: number): void => {
    let top = Infinity;
    for (let b = p; b <= q; b++) top = Math.min(top, bounds[b].x, b < q ? link(b) : Infinity);
    if (top > base) raw.push({ rep: bounds[p].last.rep, start: base, end: top, lo: bounds[p].lo, hi: bounds[q].lo + 1 });
    for (let a = p; a <= q;) {
      if (bounds[a].x <= top) {
        a++;
        continue;
      }
      let z = a;
      while (z < q && link(z) > top && bounds[z + 1].x > top) z++;
      solve(a, z, top);
      a = z + 1;
    }
  };
  if (bounds.length > 0) solve(0, bounds.length - 1, 0);
  const out: SharedPiece[] = [];
  for (const r of raw) {
    // Cut where any chain leaves the path (so each rank pushes the piece as one segment), then every B tokens.
    const cuts = new Set<number>([r.start, r.end]);
    for (const c of chains) {
      const t = Math.min(c.h, lcpAt(c.rep, r.rep));
      if (t > r.start && t < r.end) cuts.add(t);
    }
    const sorted = [...cuts].sort((x, y) => x - y);
    const ranks = Array.from({ length: r.hi - r.lo + 1 }, (_, k) => r.lo + k);
    for (let k = 0; k + 1 < sorted.length; k++) {
      for (let s = sorted[k]; s < sorted[k + 1]; s += B) {
        const e = Math.min(s + B, sorted[k + 1]);
        out.push({ rep: r.rep, start: s, end: e, ranks, ranges: shareRanges(s, e, ranks.length) });
      }
    }
  }
  return out;
}

/** [s, e) cut into n contiguous ranges of near-equal length, one per rank (empty where e − s < n). */
export function shareRanges(s: number, e: number, n: number): [number, number][] {
  const L = e - s;
  return Array.from({ length: n }, (_, i) => [s + Math.floor((i * L) / n), s + Math.floor(((i + 1) * L) / n)]);
}

/** The pieces on the root path of chain (rep, h), shallowest first. */
export function piecesOn(pieces: readonly SharedPiece[], rep: number, h: number, lcpAt: (a: number, b: number) => number): number[] {
  const ids: number[] = [];
  pieces.forEach((p, id) => {
    if (p.end <= h && lcpAt(rep, p.rep) >= p.end) ids.push(id);
  });
  return ids.sort((x, y) => pieces[x].start - pieces[y].start);
}
