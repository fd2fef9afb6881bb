/**
 * Mask lowerings through the backend registry, and the form they take in micro-batch files
 * (`treepack pack --masks block:128,slices`).
 */
import { resolveKernel, type BackendName } from '../backend/index.js';
import { TreepackError } from '../errors.js';
import type { Tensor } from '../io/safetensors.js';
import { DEFAULT_BLOCK_SIZE, type TreeArrays } from './types.js';
import { validateBlockSize } from './validate.js';

export type MaskSpec = { kind: 'blocks'; blockSize: number } | { kind: 'slices' } | { kind: 'cu_seqlens' };

export const MASKS_OPTION_HELP = 'block[:B] (FlexAttention BlockMask, B default 128), slices (MagiAttention), cu_seqlens (forests with no sharing)';

/** Parses `block:128,slices`; each lowering at most once (they share tensor names in the file). */
export function parseMaskSpecs(text: string): MaskSpec[] {
  const specs: MaskSpec[] = [];
  for (const item of text.split(',').map((s) => s.trim()).filter(Boolean)) {
    const [name, arg, ...rest] = item.split(':');
    let spec: MaskSpec;
    if ((name === 'block' || name === 'blocks') && rest.length === 0) {
      const B = arg === undefined ? DEFAULT_BLOCK_SIZE : Number(arg);
      try {
        spec = { kind: 'blocks', blockSize: validateBlockSize(arg === undefined || /^[0-9]+$/.test(arg) ? B : NaN) };
      } catch {
        throw new TreepackError('E_ARG', `Expected a block size in [1, 2^20] in --masks ${JSON.stringify(item)}`);
      }
    } else if ((name === 'slices' || name === 'cu_seqlens') && arg === undefined) {
      spec = { kind: name };
    } else {
      throw new TreepackError('E_ARG', `Expected a list of ${MASKS_OPTION_HELP} for --masks but received ${JSON.stringify(item)}`);
    }
    if (specs.some((s) => s.kind === spec.kind)) throw new TreepackError('E_ARG', `--masks names ${spec.kind} twice`);
    specs.push(spec);
  }
  return specs;
}

export interface MaskTensors {
  tensors: Map<string, Tensor>;
  /** Extra header metadata: `block_size` when a block mask is present. */
  metadata: Record<string, string>;
  /** Per lowering, which backend built it and why. */
  reports: string[];
}

/** Builds the lowerings of `specs` on the best available backend (or `backend`), as micro-batch tensors. */
export async function maskTensors(tree: TreeArrays, specs: readonly MaskSpec[], backend?: BackendName | 'auto'): Promise<MaskTensors> {
  const tensors = new Map<string, Tensor>();
  const metadata: Record<string, string> = {};
  const reports: string[] = [];
  for (const spec of specs) {
    if (spec.kind === 'blocks') {
      const r = await resolveKernel('maskBlocks', backend);
      const m = await r.kernel(tree, spec.blockSize);
      const nb = m.num_blocks;
      tensors.set('block_kv_num_blocks', { dtype: 'I32', shape: [nb], data: m.block_kv_num_blocks });
      tensors.set('block_kv_indices', { dtype: 'I32', shape: [nb, nb], data: m.block_kv_indices });
      tensors.set('block_full_kv_num_blocks', { dtype: 'I32', shape: [nb], data: m.block_full_kv_num_blocks });
      tensors.set('block_full_kv_indices', { dtype: 'I32', shape: [nb, nb], data: m.block_full_kv_indices });
      metadata.block_size = String(m.block_size);
      reports.push(r.report);
    } else if (spec.kind === 'slices') {
      const r = await resolveKernel('maskSlices', backend);
      const s = await r.kernel(tree);
      tensors.set('slices', { dtype: 'I32', shape: [s.length / 5, 5], data: s });
      reports.push(r.report);
    } else {
      const r = await resolveKernel('maskCuSeqlens', backend);
      const c = await r.kernel(tree);
      tensors.set('cu_seqlens', { dtype: 'I32', shape: [c.length], data: c });
      reports.push(r.report);
    }
  }
  return { tensors, metadata, reports };
}

export * from './types.js';
export { maskDense, maskBits, bitsWordsPerRow } from './dense.js';
export { maskBlocks, numBlocks, blockMaskBytes } from './blocks.js';
export { maskSlices } from './slices.js';
export { maskCuSeqlens } from './cuseqlens.js';
export { validateTree } from './validate.js';
