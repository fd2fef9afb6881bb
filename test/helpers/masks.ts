/**
 * Decoders that turn each lowering back into visible pairs, independently of how it was built, so tests can hold
 * every lowering against the ancestor relation.
 */
import type { BlockMask } from '../../src/mask/types.js';

/**
 * Checks a BlockMask against `visible` pair by pair and returns the first problem, or '' when it is exact:
 * listed rows ascending with zero padding, no empty block listed, full blocks whole B×B tiles with every pair
 * visible, partial blocks neither empty nor full, and every visible pair inside a listed block.
 */
export function blockMaskProblem(m: BlockMask, N: number, visible: (q: number, k: number) => boolean): string {
  const B = m.block_size,
    nb = m.num_blocks;
  if (nb !== Math.ceil(N / B)) return `num_blocks ${nb} for N = ${N}, B = ${B}`;
  const kind = new Int8Array(nb * nb); // 0 unlisted, 1 partial, 2 full
  for (const [nums, idx, k] of [
    [m.block_kv_num_blocks, m.block_kv_indices, 1],
    [m.block_full_kv_num_blocks, m.block_full_kv_indices, 2],
  ] as const) {
    if (nums.length !== nb || idx.length !== nb * nb) return 'array lengths';
    for (let i = 0; i < nb; i++) {
      for (let t = 0; t < nb; t++) {
        const j = idx[i * nb + t];
        if (t >= nums[i]) {
          if (j !== 0) return `row ${i}: padding ${j} at ${t}`;
          continue;
        }
        if (t > 0 && j <= idx[i * nb + t - 1]) return `row ${i}: not ascending at ${t}`;
        if (kind[i * nb + j] !== 0) return `block (${i}, ${j}) listed twice`;
        kind[i * nb + j] = k;
      }
    }
  }
  for (let i = 0; i < nb; i++) {
    for (let j = 0; j < nb; j++) {
      let seen = 0,
        total = 0;
      for (let q = i * B; q < Math.min(N, (i + 1) * B); q++) {
        for (let k = j * B; k < Math.min(N, (j + 1) * B); k++) {
          total++;
          if (visible(q, k)) seen++;
        }
      }
      const whole = total === B * B && seen === total;
      const expected = seen === 0 ? 0 : whole ? 2 : 1;
      if (kind[i * nb + j] !== expected)
        return `block (${i}, ${j}): listed as ${kind[i * nb + j]}, expected ${expected} (${seen}/${total} visible)`;
    }
  }
  return '';
}

/** How many slices of [K, 5] rows cover each pair, as [N, N] counts; kind 0 full, 1 causal (k <= q). */
export function sliceCoverage(slices: Int32Array, N: number): Uint8Array {
  const cover = new Uint8Array(N * N);
  for (let s = 0; s < slices.length; s += 5) {
    const [qs, qe, ks, ke, kind] = slices.subarray(s, s + 5);
    if (kind === 1 && (qs !== ks || qe !== ke)) throw new Error(`causal slice ${s / 5} with q range ≠ k range`);
    for (let q = qs; q < qe; q++) for (let k = ks; k < ke; k++) if (kind === 0 || k <= q) cover[q * N + k]++;
  }
  return cover;
}
