/**
 * docs/design.md §7 invariants 1, 2 and 4 checked on a forest in O(N + M), for data of any origin (a backend's output,
 * a file from disk). Nothing here trusts the arrays: every index is range-checked before use.
 */
import { OPTIONAL_OCCURRENCE_FIELDS, type Forest, type MicroBatch, type Sequences } from './contract.js';

/** A broken forest tends to break at every node; the first violations say what is wrong, the rest only count. */
const MAX_REPORTED = 100;

class Violations {
  readonly list: string[] = [];
  count = 0;
  add(message: string): void {
    if (this.count++ < MAX_REPORTED) this.list.push(message);
  }
  result(): string[] {
    return this.count > MAX_REPORTED ? [...this.list, `… and ${this.count - MAX_REPORTED} more violations`] : this.list;
  }
}

/**
 * Tree invariants. Parents must precede their children (which also makes the parent relation acyclic). One
 * backward pass then recomputes, per node, the end of the smallest interval holding its subtree and its subtree's
 * size: the interval is exactly the subtree, as the attention rule `k <= q < subtree_end[k]` needs, iff its
 * length equals that size (the layout is a DFS preorder).
 */
function checkTree(parent: Int32Array, subtree_end: Int32Array, out: Violations): void {
  const N = parent.length;
  const end = new Int32Array(N);
  const size = new Int32Array(N);
  for (let p = 0; p < N; p++) {
    end[p] = p + 1;
    size[p] = 1;
    const q = parent[p];
    if (!(q >= -1 && q < p)) out.add(`parent[${p}] = ${q}: expected -1 (a root) or a position before ${p}`);
  }
  for (let p = N - 1; p >= 0; p--) {
    const q = parent[p];
    if (q >= 0 && q < p) {
      if (end[p] > end[q]) end[q] = end[p];
      size[q] += size[p];
    }
  }
  for (let p = 0; p < N; p++) {
    if (end[p] - p !== size[p]) {
      out.add(
        `subtree of ${p} is not contiguous: positions ${p}..${end[p] - 1} hold only ${size[p]} of its nodes (layout is not a DFS preorder)`,
      );
    }
    if (subtree_end[p] !== end[p]) out.add(`subtree_end[${p}] = ${subtree_end[p]}: expected ${end[p]} from parent`);
  }
}

/** Violations of the tree invariants alone (parent before child, DFS preorder, subtree_end from parent). */
export function treeViolations(parent: Int32Array, subtree_end: Int32Array): string[] {
  const out = new Violations();
  checkTree(parent, subtree_end, out);
  return out.result();
}

/** Node invariants: the tree, and position_ids = depth. */
function checkNodes(f: Forest, out: Violations): void {
  const { position_ids, parent, subtree_end } = f;
  checkTree(parent, subtree_end, out);
  for (let p = 0; p < parent.length; p++) {
    const q = parent[p];
    if (!(q >= -1 && q < p)) continue;
    const depth = q < 0 ? 0 : position_ids[q] + 1;
    if (position_ids[p] !== depth) {
      out.add(
        `position_ids[${p}] = ${position_ids[p]}: expected ${depth} (${q < 0 ? 'a root' : `parent ${q} has position ${position_ids[q]}`})`,
      );
    }
  }
}

/** CSR shape of seq_offsets; the occurrence checks index through it only when it holds. */
function checkOffsets(offsets: Int32Array, M: number, out: Violations): boolean {
  const S = offsets.length - 1;
  if (S < 0) {
    out.add('seq_offsets is empty: expected S+1 >= 1 entries');
    return false;
  }
  let ok = true;
  if (offsets[0] !== 0) {
    out.add(`seq_offsets[0] = ${offsets[0]}: expected 0`);
    ok = false;
  }
  for (let i = 0; i < S; i++) {
    if (offsets[i + 1] < offsets[i]) {
      out.add(`seq_offsets[${i + 1}] = ${offsets[i + 1]}: less than seq_offsets[${i}] = ${offsets[i]}`);
      ok = false;
    }
  }
  if (offsets[S] !== M) {
    out.add(`seq_offsets[${S}] = ${offsets[S]}: expected M = ${M} (length of seq_positions)`);
    ok = false;
  }
  return ok;
}

function sameOffsets(a: Int32Array, b: Int32Array): boolean {
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
  return true;
}

/**
 * Violations of docs/design.md §7 invariants 1, 2 and 4 (empty when the forest is valid): node arrays of one length,
 * parent before child, position_ids = depth, subtree_end = the end of each node's contiguous subtree, and per
 * occurrence: seq_positions in range, parent[seq_positions[t]] = seq_positions[t-1] (-1 at t = 0),
 * position_ids[seq_positions[t]] = t. With `seqs` (the sequences the forest was packed from) also
 * input_ids[seq_positions] = tokens. Given a MicroBatch it also checks the occurrence fields' lengths and that
 * loss_mask is 0 at t = 0, that turn_ids never decrease along a sequence, and that its num_pad_tokens pad nodes are
 * childless roots no occurrence maps to.
 */
export function checkForest(forest: Forest | MicroBatch, seqs?: Sequences): string[] {
  const out = new Violations();
  const { input_ids, position_ids, parent, subtree_end, seq_offsets, seq_positions } = forest;
  const N = input_ids.length;
  const M = seq_positions.length;
  const nodeLengths = { position_ids: position_ids.length, parent: parent.length, subtree_end: subtree_end.length };
  for (const [name, len] of Object.entries(nodeLengths)) {
    if (len !== N) out.add(`${name} has ${len} elements: expected N = ${N} (length of input_ids)`);
  }
  if (out.count > 0) return out.result();
  checkNodes(forest, out);

  const mb = 'loss_mask' in forest ? forest : undefined;
  let lossMask = mb?.loss_mask;
  let turns = mb?.turn_ids;
  for (const name of ['loss_mask', ...OPTIONAL_OCCURRENCE_FIELDS] as const) {
    const a = mb?.[name];
    if (a !== undefined && a.length !== M) {
      out.add(`${name} has ${a.length} elements: expected M = ${M} (length of seq_positions)`);
      if (name === 'loss_mask') lossMask = undefined;
      if (name === 'turn_ids') turns = undefined;
    }
  }
  let tokens = seqs?.tokens;
  if (seqs !== undefined && !sameOffsets(seqs.offsets, seq_offsets)) {
    out.add('seq_offsets differ from the offsets of the given sequences');
    tokens = undefined;
  }
  if (!checkOffsets(seq_offsets, M, out)) return out.result();

  // Padding (the num_pad_tokens extension) is the tail of the node arrays: roots no sequence reaches.
  const pad = Math.min(N, mb?.meta?.num_pad_tokens ?? 0);
  for (let p = N - pad; p < N; p++) {
    if (parent[p] !== -1 || subtree_end[p] !== p + 1)
      out.add(`pad node ${p}: expected a root with no children (parent -1, subtree_end ${p + 1})`);
  }
  const S = seq_offsets.length - 1;
  for (let i = 0; i < S; i++) {
    const off = seq_offsets[i];
    const len = seq_offsets[i + 1] - off;
    for (let t = 0; t < len; t++) {
      const k = off + t;
      const p = seq_positions[k];
      const at = `(sequence ${i}, t = ${t})`;
      if (lossMask !== undefined && t === 0 && lossMask[k] !== 0) out.add(`loss_mask[${k}] = ${lossMask[k]}: expected 0 at t = 0 ${at}`);
      if (turns !== undefined && t > 0 && turns[k] < turns[k - 1])
        out.add(
          `turn_ids[${k}] = ${turns[k]}: below turn_ids[${k - 1}] = ${turns[k - 1]} (turn ids never decrease along a sequence) ${at}`,
        );
      if (!(p >= 0 && p < N)) {
        out.add(`seq_positions[${k}] = ${p}: not a position in [0, ${N}) ${at}`);
        continue;
      }
      if (p >= N - pad) out.add(`seq_positions[${k}] = ${p}: a pad node (the last ${pad} nodes are padding) ${at}`);
      const expectedParent = t === 0 ? -1 : seq_positions[k - 1];
      if (parent[p] !== expectedParent) {
        out.add(
          `parent[seq_positions[${k}]] = parent[${p}] = ${parent[p]}: expected ${t === 0 ? '-1 (a root)' : `seq_positions[${k - 1}] = ${expectedParent}`} ${at}`,
        );
      }
      if (position_ids[p] !== t)
        out.add(`position_ids[seq_positions[${k}]] = position_ids[${p}] = ${position_ids[p]}: expected ${t} ${at}`);
      if (tokens !== undefined && input_ids[p] !== tokens[k]) {
        out.add(`input_ids[seq_positions[${k}]] = input_ids[${p}] = ${input_ids[p]}: expected token ${tokens[k]} ${at}`);
      }
    }
  }
  return out.result();
}
