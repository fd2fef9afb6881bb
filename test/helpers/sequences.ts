/** Seeded random batches of token sequences for property tests (shared by every backend's suite). */
import { concatSequences as csr } from '../../src/pack/batch.js';
import { FORMAT, OCCURRENCE_FLOAT_FIELDS, type MicroBatch, type Sequences } from '../../src/pack/contract.js';
import { packForest } from '../../src/pack/forest.js';

export { csr };

/** mulberry32: small, fast, and deterministic across platforms. */
export function rng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

export function toArrays(s: Sequences): number[][] {
  const out: number[][] = [];
  for (let i = 0; i + 1 < s.offsets.length; i++) out.push(Array.from(s.tokens.subarray(s.offsets[i], s.offsets[i + 1])));
  return out;
}

/**
 * Random sequences with heavy sharing: each new sequence is, with some probability, a prefix of an earlier one
 * extended by fresh tokens, an exact duplicate, or a fresh sequence; small alphabets make accidental sharing
 * likely too.
 */
export function randomBatch(seed: number, opts: { count?: number; maxLen?: number; alphabet?: number } = {}): number[][] {
  const r = rng(seed);
  const count = opts.count ?? 1 + Math.floor(r() * 40);
  const maxLen = opts.maxLen ?? 24;
  const alphabet = opts.alphabet ?? 2 + Math.floor(r() * 6);
  const tok = () => Math.floor(r() * alphabet);
  const out: number[][] = [];
  for (let i = 0; i < count; i++) {
    const u = r();
    if (out.length && u < 0.15) out.push(out[Math.floor(r() * out.length)].slice());
    else if (out.length && u < 0.7) {
      const base = out[Math.floor(r() * out.length)];
      const cut = Math.floor(r() * (base.length + 1));
      const s = base.slice(0, cut);
      const extra = Math.floor(r() * maxLen);
      for (let k = 0; k < extra; k++) s.push(tok());
      out.push(s);
    } else {
      const len = Math.floor(r() * maxLen);
      out.push(Array.from({ length: len }, tok));
    }
  }
  return out;
}

/** Agent-shaped chains: per episode, request k+1 extends request k; episodes of a group share a long prompt. */
export function agentBatch(
  seed: number,
  opts: { groups: number; episodes: number; turns: number; prompt: number; step: number },
): Sequences {
  const r = rng(seed);
  const seqs: Int32Array[] = [];
  for (let g = 0; g < opts.groups; g++) {
    const prompt = Array.from({ length: opts.prompt }, () => 1 + Math.floor(r() * 150000));
    for (let e = 0; e < opts.episodes; e++) {
      const ep = prompt.slice();
      for (let t = 0; t < opts.turns; t++) {
        for (let k = 0; k < opts.step; k++) ep.push(1 + Math.floor(r() * 150000));
        seqs.push(Int32Array.from(ep));
      }
    }
  }
  return csr(seqs);
}

/** Fisher–Yates in place; returns `xs`. */
export function shuffle<T>(xs: T[], rand: () => number): T[] {
  for (let i = xs.length - 1; i > 0; i--) {
    const j = Math.floor(rand() * (i + 1));
    [xs[i], xs[j]] = [xs[j], xs[i]];
  }
  return xs;
}

export function shuffled<T>(xs: readonly T[], seed: number): { items: T[]; perm: number[] } {
  const perm = shuffle(
    xs.map((_, i) => i),
    rng(seed),
  );
  return { items: perm.map((i) => xs[i]), perm };
}

/** A seeded micro-batch: empty (seed % 10 = 0), empty sequences (1), else random; random float fields and ids. */
export function randomMicroBatch(seed: number): { batch: MicroBatch; seqs: Sequences } {
  const r = rng(seed * 7919 + 3);
  const arrays = seed % 10 === 0 ? [] : seed % 10 === 1 ? [[], [4], []] : randomBatch(seed);
  const seqs = csr(arrays);
  const forest = packForest(seqs);
  const M = seqs.tokens.length;
  const loss_mask = new Uint8Array(M);
  for (let i = 0; i < arrays.length; i++) {
    for (let t = 1; t < arrays[i].length; t++) loss_mask[seqs.offsets[i] + t] = r() < 0.6 ? 1 : 0;
  }
  const batch: MicroBatch = {
    ...forest,
    loss_mask,
    meta: {
      format: FORMAT,
      num_sequences: arrays.length,
      num_tokens_naive: M,
      num_tokens_packed: forest.input_ids.length,
      tokenizer: seed % 3 === 0 ? 'Qwen/Qwen3-8B' : '',
      sequence_ids: arrays.map((_, i) => (i % 5 === 4 ? `ü"\\\n${i}` : `s${seed}-${i}`)),
    },
  };
  for (const f of OCCURRENCE_FLOAT_FIELDS) {
    if (r() < 0.5) batch[f] = Float32Array.from({ length: M }, () => (r() - 0.5) * 20);
  }
  return { batch, seqs };
}
