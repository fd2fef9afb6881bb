/** `--masks block:128,slices`: the flag's parser and help text (the lowerings themselves are src/mask). */
import { TreepackError } from '../errors.js';
import { DEFAULT_BLOCK_SIZE, type MaskSpec } from '../mask/types.js';
import { validateBlockSize } from '../mask/validate.js';

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
