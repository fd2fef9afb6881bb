/**
 * Loads the native addons: the CPU addon `treepack.node` (node-gyp: build/Release, or cmake-js: build-cmake/Release)
 * and, lazily and separately, the CUDA addon `treepack_cuda.node` (cmake-js only). Loading never throws: every
 * failed attempt is collected into one `error` string that says why the backend is unavailable.
 *
 * Which file, in order (better-sqlite3's `nativeBinding`): the binding given to `configureBackends` (a path, or an
 * addon object already loaded), else TREEPACK_NATIVE_BINDING / TREEPACK_CUDA_BINDING (one addon file, relative to
 * the working directory), else the build directories of this package. A given binding or variable is the only one
 * tried.
 */
import fs from 'node:fs';
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { TreepackError } from '../errors.js';
import type { BlockMask } from '../mask/types.js';
import type { Forest, Sequences } from '../pack/contract.js';
import { validateSequences } from '../pack/validate.js';
import { ABI_HASH } from './abi.js';
import type { LossAddon } from './loss-addon.js';

/**
 * Preallocated output arrays for reuse across calls. Each given array must be at least as long as needed (N for the
 * node arrays, for which M is always enough; M for seq_positions; S+1 for seq_offsets) and must not share memory with
 * the input or another output. The returned Forest holds views of exactly the needed length on the same memory.
 */
export type ForestBuffers = Partial<Forest>;

export interface NativeBinding extends LossAddon {
  packForest(tokens: Int32Array, offsets: Int32Array, out?: ForestBuffers): Forest;
  /** Mask lowerings (native/core/mask.h); the arrays are validated by src/mask/validate.ts first. */
  maskDense(parent: Int32Array, subtree_end: Int32Array): Uint8Array;
  maskBits(parent: Int32Array, subtree_end: Int32Array): Uint32Array;
  maskBlocks(subtree_end: Int32Array, blockSize: number): Omit<BlockMask, 'block_size' | 'num_blocks'>;
  maskSlices(parent: Int32Array, subtree_end: Int32Array): Int32Array;
  maskCuSeqlens(parent: Int32Array): Int32Array;
  version(): string;
  /** The fingerprint of the ABI tables it was built with (TP_ABI). */
  abi(): string;
  init(errorClass: typeof TreepackError): void;
}

export interface CudaDevice {
  name: string;
  major: number; // compute capability
  minor: number;
  totalGlobalMem: number; // bytes
  multiProcessorCount: number;
}

export interface CudaBinding extends LossAddon {
  /** code is a cudaError_t: 0 ok, 35 no driver or one older than the runtime, 100 no device. */
  deviceInfo(): { code: number; message: string; runtimeVersion: number; driverVersion: number; devices: CudaDevice[] };
  /** dst[i] = src[idx[i]] on the first GPU (an index outside src gives 0); throws TreepackError E_BACKEND. */
  gatherI32(src: Int32Array, idx: Int32Array): Int32Array;
  /** Mask lowerings on the first GPU (native/cuda/mask.cu); kernelMs is the kernels' own time. E_BACKEND on failure. */
  maskDense(parent: Int32Array, subtree_end: Int32Array): { data: Uint8Array; kernelMs: number };
  maskBits(parent: Int32Array, subtree_end: Int32Array): { data: Uint32Array; kernelMs: number };
  maskBlocks(subtree_end: Int32Array, blockSize: number): { data: Omit<BlockMask, 'block_size' | 'num_blocks'>; kernelMs: number };
  version(): string;
  abi(): string;
  init(errorClass: typeof TreepackError): void;
}

export type Loaded<B> = { binding: B; path: string } | { error: string };

export type CudaDeviceInfo = { available: true; devices: CudaDevice[] } | { available: false; reason: string };

const requireAddon = createRequire(import.meta.url);

/** The nearest directory above this file whose package.json is treepack's: works from src/ and from dist/src/. */
function packageRoot(): string {
  const here = path.dirname(fileURLToPath(import.meta.url));
  for (let dir = here; ; dir = path.dirname(dir)) {
    try {
      const pkg = JSON.parse(fs.readFileSync(path.join(dir, 'package.json'), 'utf8')) as { name?: unknown };
      if (pkg.name === 'treepack') return dir;
    } catch {
      // no package.json here, or not ours: keep walking up
    }
    if (path.dirname(dir) === dir) return path.resolve(here, '..', '..');
  }
}

/** The functions each addon must export: a binding injected by a trainer is checked against them. */
const NATIVE_FUNCTIONS = [
  'packForest',
  'maskDense',
  'maskBits',
  'maskBlocks',
  'maskSlices',
  'maskCuSeqlens',
  'loss',
  'lossCompact',
  'version',
  'abi',
  'init',
] as const;
const CUDA_FUNCTIONS = [
  'deviceInfo',
  'gatherI32',
  'maskDense',
  'maskBits',
  'maskBlocks',
  'loss',
  'lossCompact',
  'version',
  'abi',
  'init',
] as const;

/**
 * Calls init(TreepackError) on a loaded addon after checking it exports every function the backend uses and was
 * built from this package's ABI tables (src/backend/abi.ts): a stale or foreign build would misread the config.
 */
function adopt<B extends { init(errorClass: typeof TreepackError): void }>(binding: unknown, functions: readonly string[]): B {
  if (binding === null || typeof binding !== 'object') throw new Error(`not an addon object (${typeof binding})`);
  const missing = functions.filter((f) => typeof (binding as Record<string, unknown>)[f] !== 'function');
  if (missing.length) throw new Error(`not a treepack addon of this version: missing ${missing.join(', ')} (rebuild it)`);
  const abi = (binding as { abi(): string }).abi();
  if (abi !== ABI_HASH) throw new Error(`built from other ABI tables (${abi}, this package has ${ABI_HASH}): rebuild it`);
  (binding as B).init(TreepackError);
  return binding as B;
}

function loadAddon<B extends { init(errorClass: typeof TreepackError): void }>(
  overrideVar: string,
  relativePaths: string[],
  buildHint: string,
  functions: readonly string[],
): Loaded<B> {
  const override = process.env[overrideVar];
  const root = override ? '' : packageRoot();
  const candidates = override ? [path.resolve(override)] : relativePaths.map((p) => path.join(root, p));
  const errors: string[] = [];
  for (const file of candidates) {
    if (!fs.existsSync(file)) {
      errors.push(`${file}: not found`);
      continue;
    }
    try {
      return { binding: adopt<B>(requireAddon(file), functions), path: file };
    } catch (e) {
      errors.push(`${file}: ${e instanceof Error ? e.message : String(e)}`);
    }
  }
  const prefix = override ? `${overrideVar} is set; ` : '';
  return { error: `${prefix}${errors.join('; ')} (${buildHint})` };
}

let native: Loaded<NativeBinding> | undefined;
let cuda: Loaded<CudaBinding> | undefined;

/** The CPU addon, loaded once; `{error}` says why it is unavailable. */
export function loadNative(): Loaded<NativeBinding> {
  native ??= loadAddon<NativeBinding>(
    'TREEPACK_NATIVE_BINDING',
    ['build/Release/treepack.node', 'build-cmake/Release/treepack.node'],
    'build it with `npm run build:native`',
    NATIVE_FUNCTIONS,
  );
  return native;
}

/** The CUDA addon, loaded on first use only; loading succeeds without a GPU or driver (see cudaDeviceInfo). */
export function loadCuda(): Loaded<CudaBinding> {
  cuda ??= loadAddon<CudaBinding>(
    'TREEPACK_CUDA_BINDING',
    ['build-cmake/Release/treepack_cuda.node'],
    'build it with `npm run build:cuda` on a machine with nvcc',
    CUDA_FUNCTIONS,
  );
  return cuda;
}

/** A binding handed over by the caller: an addon file to load, or an addon object already loaded. */
export type BindingSource<B> = string | B;

function inject<B extends { init(errorClass: typeof TreepackError): void }>(
  option: string,
  source: BindingSource<B>,
  functions: readonly string[],
): Loaded<B> {
  const where = typeof source === 'string' ? path.resolve(source) : 'the given object';
  try {
    const binding: unknown = typeof source === 'string' ? requireAddon(where) : source;
    return { binding: adopt<B>(binding, functions), path: where };
  } catch (e) {
    throw new TreepackError(
      'E_ARG',
      `${option}: ${where} is not a usable treepack addon: ${e instanceof Error ? e.message.split('\n')[0] : String(e)}`,
      { field: option },
    );
  }
}

/** Uses `source` as the CPU addon from now on (throws E_ARG, keeping the current one, when it cannot be used). */
export function injectNative(source: BindingSource<NativeBinding>): void {
  native = inject<NativeBinding>('nativeBinding', source, NATIVE_FUNCTIONS);
}

/** Uses `source` as the CUDA addon from now on (throws E_ARG, keeping the current one, when it cannot be used). */
export function injectCuda(source: BindingSource<CudaBinding>): void {
  cuda = inject<CudaBinding>('cudaBinding', source, CUDA_FUNCTIONS);
}

/** Whether the CUDA backend can run here, and if not, why (no addon, no driver, no device). Never throws. */
export function cudaDeviceInfo(): CudaDeviceInfo {
  const loaded = loadCuda();
  if ('error' in loaded) return { available: false, reason: `CUDA addon not loaded: ${loaded.error}` };
  const info = loaded.binding.deviceInfo();
  if (info.code !== 0) {
    return { available: false, reason: `CUDA error ${info.code}: ${info.message} (driver version ${info.driverVersion})` };
  }
  if (info.devices.length === 0) return { available: false, reason: 'no CUDA device' };
  return { available: true, devices: info.devices };
}

/** packForest (src/pack/forest.ts) on the CPU addon: the same arrays, byte for byte. */
export function packForestNative(seqs: Sequences, out?: ForestBuffers): Forest {
  validateSequences(seqs);
  const loaded = loadNative();
  if ('error' in loaded) throw new TreepackError('E_BACKEND', `native backend unavailable: ${loaded.error}`);
  return loaded.binding.packForest(seqs.tokens, seqs.offsets, out);
}
