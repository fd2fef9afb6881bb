/**
 * The form mask lowerings take in micro-batch files: which ones a file carries (the list syntax of
 * `treepack pack --masks block:128,slices` and of the packer's `masks` option), their tensor names and shapes, and
 * the `block_size` header key. The lowerings are built through the backend registry.
 */
import { lowerMasks, type BackendName } from '../backend/index.js';
import { TreepackError } from '../errors.js';
import { DEFAULT_BLOCK_SIZE, type MaskSpec, type TreeArrays } from '../mask/types.js';
import { validateBlockSize } from '../mask/validate.js';
import type { Tensor } from './safetensors.js';

export const MASKS_OPTION_HELP =
  'block[:B] (FlexAttention BlockMask, B default 128), slices (MagiAttention), cu_seqlens (forests with no sharing)';

/**
 * Parses `block:128,slices`; each lowering at most once (they share tensor names in the file). Errors name `option`:
 * the flag, or the library's option.
 */
export function parseMaskSpecs(text: string, option = '--masks'): MaskSpec[] {
  const specs: MaskSpec[] = [];
  for (const item of text
    .split(',')
    .map((s) => s.trim())
    .filter(Boolean)) {
    const [name, arg, ...rest] = item.split(':');
    let spec: MaskSpec;
    if ((name === 'block' || name === 'blocks') && rest.length === 0) {
      const B = arg === undefined ? DEFAULT_BLOCK_SIZE : Number(arg);
      try {
        spec = { kind: 'blocks', blockSize: validateBlockSize(arg === undefined || /^[0-9]+$/.test(arg) ? B : NaN) };
      } catch {
        throw new TreepackError('E_ARG', `Expected a block size in [1, 2^20] in ${option} ${JSON.stringify(item)}`);
      }
    } else if ((name === 'slices' || name === 'cu_seqlens') && arg === undefined) {
      spec = { kind: name };
    } else {
      throw new TreepackError('E_ARG', `Expected a list of ${MASKS_OPTION_HELP} for ${option} but received ${JSON.stringify(item)}`);
    }
    if (specs.some((s) => s.kind === spec.kind)) throw new TreepackError('E_ARG', `${option} names ${spec.kind} twice`);
    specs.push(spec);
  }
  return specs;
}

/** Mask lowerings as micro-batch file content: tensors, header keys, and which backend built each. */
export interface MaskTensors {
  tensors: Map<string, Tensor>;
  /** Extra header metadata: `block_size` when a block mask is present. */
  metadata: Record<string, string>;
  /** Per lowering, which backend built it and why. */
  reports: string[];
}

/** Builds the lowerings of `specs` on the best available backend (or `backend`), as micro-batch tensors. */
export async function maskTensors(tree: TreeArrays, specs: readonly MaskSpec[], backend?: BackendName | 'auto'): Promise<MaskTensors> {
  const { blocks, slices, cuSeqlens, reports } = await lowerMasks(tree, specs, backend);
  const tensors = new Map<string, Tensor>();
  const metadata: Record<string, string> = {};
  if (blocks) {
    const nb = blocks.num_blocks;
    tensors.set('block_kv_num_blocks', { dtype: 'I32', shape: [nb], data: blocks.block_kv_num_blocks });
    tensors.set('block_kv_indices', { dtype: 'I32', shape: [nb, nb], data: blocks.block_kv_indices });
    tensors.set('block_full_kv_num_blocks', { dtype: 'I32', shape: [nb], data: blocks.block_full_kv_num_blocks });
    tensors.set('block_full_kv_indices', { dtype: 'I32', shape: [nb, nb], data: blocks.block_full_kv_indices });
    metadata.block_size = String(blocks.block_size);
  }
  if (slices) tensors.set('slices', { dtype: 'I32', shape: [slices.length / 5, 5], data: slices });
  if (cuSeqlens) tensors.set('cu_seqlens', { dtype: 'I32', shape: [cuSeqlens.length], data: cuSeqlens });
  return { tensors, metadata, reports };
}
