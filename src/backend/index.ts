/** Registers the built-in backends, each with its life cycle and kernels. Importing this module makes them resolvable. */
import { TreepackError } from '../errors.js';
import { lossCompactReference, lossReference } from '../loss/reference.js';
import { lowerBlocks } from '../mask/blocks.js';
import { lowerCuSeqlens } from '../mask/cuseqlens.js';
import { lowerBits, lowerDense } from '../mask/dense.js';
import { lowerSlices } from '../mask/slices.js';
import { layoutForest, sortSequences } from '../pack/forest.js';
import { addonLoss, addonLossCompact, type LossAddon } from './loss-addon.js';
import { maskBitsCuda, maskBlocksCuda, maskDenseCuda } from './mask-cuda.js';
import { maskBitsCpu, maskBlocksCpu, maskCuSeqlensCpu, maskDenseCpu, maskSlicesCpu } from './mask-cpu.js';
import {
  cudaDeviceInfo,
  injectCuda,
  injectNative,
  loadCuda,
  loadNative,
  type BindingSource,
  type CudaBinding,
  type Loaded,
  type NativeBinding,
} from './native.js';
import { registerBackend, registerKernel, resetBackend } from './registry.js';
import { releaseWebGPU, webgpuContext, type WebGPUContext } from './webgpu/device.js';
import { lossCompactWebGPU, lossWebGPU } from './webgpu/loss.js';
import { maskBitsWebGPU, maskBlocksWebGPU, maskDenseWebGPU } from './webgpu/mask.js';

registerBackend({ name: 'js', priority: 0, init: () => 'TypeScript reference' });
registerKernel('js', 'packForest', (seqs) => layoutForest(seqs, sortSequences(seqs)));
registerKernel('js', 'maskDense', async (t) => lowerDense(t));
registerKernel('js', 'maskBits', async (t) => lowerBits(t));
registerKernel('js', 'maskBlocks', async (t, b) => lowerBlocks(t, b));
registerKernel('js', 'maskSlices', async (t) => lowerSlices(t));
registerKernel('js', 'maskCuSeqlens', async (t) => lowerCuSeqlens(t));
registerKernel('js', 'loss', async (b, lp, cfg) => lossReference(b, lp, cfg));
registerKernel('js', 'lossCompact', async (plan, lp, cfg) => lossCompactReference(plan, lp, cfg));

function addon(loaded: Loaded<LossAddon>, name: string): LossAddon {
  if ('error' in loaded) throw new TreepackError('E_BACKEND', `${name} addon unavailable: ${loaded.error}`);
  return loaded.binding;
}

registerBackend({
  name: 'cpu',
  priority: 10,
  init: () => {
    const loaded = loadNative();
    if ('error' in loaded) throw new Error(`native addon not loaded: ${loaded.error}`);
    return `native addon ${loaded.path}`;
  },
});
registerKernel('cpu', 'packForest', (seqs) => {
  const loaded = loadNative();
  if ('error' in loaded) throw new TreepackError('E_BACKEND', `native backend unavailable: ${loaded.error}`);
  return loaded.binding.packForest(seqs.tokens, seqs.offsets);
});
registerKernel('cpu', 'maskDense', maskDenseCpu);
registerKernel('cpu', 'maskBits', maskBitsCpu);
registerKernel('cpu', 'maskBlocks', maskBlocksCpu);
registerKernel('cpu', 'maskSlices', maskSlicesCpu);
registerKernel('cpu', 'maskCuSeqlens', maskCuSeqlensCpu);
registerKernel('cpu', 'loss', async (b, lp, cfg) => addonLoss(addon(loadNative(), 'native'), b, lp, cfg));
registerKernel('cpu', 'lossCompact', async (plan, lp, cfg) => addonLossCompact(addon(loadNative(), 'native'), plan, lp, cfg));

// GPU backends: registered so that `listBackends()` says whether each can run here and why not; each kernel
// registers beside its backend.
registerBackend({
  name: 'cuda',
  priority: 30,
  init: () => {
    const info = cudaDeviceInfo();
    if (!info.available) throw new Error(info.reason);
    return info.devices.map((d) => `${d.name} (sm_${d.major}${d.minor})`).join(', ');
  },
  // The CPU emulator of native/cuda/emulate (its device name says so) runs the kernels for tests, slower than the
  // C++ core: named explicitly it runs, `auto` passes it by.
  software: () => {
    const info = cudaDeviceInfo();
    return info.available && info.devices.every((d) => /emulat/i.test(d.name));
  },
  // Outputs are built in device memory, then copied into one host typed array each.
  limits: () => {
    const info = cudaDeviceInfo();
    const bytes = Math.min(info.available ? info.devices[0].totalGlobalMem / 2 : 0, 2 ** 31);
    return { maxArrayBytes: bytes, arrayLimit: 'cuda', maxTotalBytes: bytes, totalLimit: 'cuda' };
  },
});
registerKernel('cuda', 'maskDense', maskDenseCuda);
registerKernel('cuda', 'maskBits', maskBitsCuda);
registerKernel('cuda', 'maskBlocks', maskBlocksCuda);
registerKernel('cuda', 'loss', async (b, lp, cfg) => addonLoss(addon(loadCuda(), 'CUDA'), b, lp, cfg));
registerKernel('cuda', 'lossCompact', async (plan, lp, cfg) => addonLossCompact(addon(loadCuda(), 'CUDA'), plan, lp, cfg));

let gpu: WebGPUContext | undefined;
registerBackend({
  name: 'webgpu',
  priority: 20,
  init: async () => {
    const r = await webgpuContext();
    if (!r.ok) throw new Error(r.reason);
    gpu = r.ctx;
    return `${r.ctx.description} via Dawn ${r.ctx.backend}${r.ctx.isFallbackAdapter ? ' (software adapter)' : ''}`;
  },
  software: () => gpu?.isFallbackAdapter === true,
  dispose: async () => {
    gpu = undefined;
    await releaseWebGPU();
  },
  // One storage binding per output array (128 MiB on the Mesa GL software adapter); no total beyond device memory.
  limits: () => {
    const { maxStorageBufferBindingSize, maxBufferSize } = gpu!.device.limits;
    return {
      maxArrayBytes: Math.min(maxStorageBufferBindingSize, maxBufferSize),
      arrayLimit: 'webgpu storage-buffer (maxStorageBufferBindingSize)',
      maxTotalBytes: Infinity,
      totalLimit: 'webgpu',
      device: { maxStorageBufferBindingSize, maxBufferSize },
    };
  },
});
// Slices and cu_seqlens are one sequential O(N) walk of the tree whose output the trainer consumes on the host:
// GPU backends leave them to cpu/js.
registerKernel('webgpu', 'maskDense', maskDenseWebGPU);
registerKernel('webgpu', 'maskBits', maskBitsWebGPU);
registerKernel('webgpu', 'maskBlocks', maskBlocksWebGPU);
registerKernel('webgpu', 'loss', lossWebGPU);
registerKernel('webgpu', 'lossCompact', lossCompactWebGPU);

/** Overrides of how backends load (configureBackends): native addons to use instead of this package's builds. */
export interface BackendOptions {
  /** The CPU addon to use instead of this package's build: a path to a `treepack.node`, or the loaded addon. */
  nativeBinding?: BindingSource<NativeBinding>;
  /** Likewise for the CUDA addon (`treepack_cuda.node`). */
  cudaBinding?: BindingSource<CudaBinding>;
}

/**
 * Points treepack at a trainer's own native builds (better-sqlite3's `nativeBinding`), ahead of the
 * TREEPACK_NATIVE_BINDING / TREEPACK_CUDA_BINDING variables and the package's build directories. Each binding is
 * loaded and checked now (E_ARG naming the option when it is not a treepack addon, the previous one staying in use);
 * the backend it serves starts again on its next use.
 */
export async function configureBackends(opts: BackendOptions): Promise<void> {
  if (opts.nativeBinding !== undefined) {
    injectNative(opts.nativeBinding);
    await resetBackend('cpu');
  }
  if (opts.cudaBinding !== undefined) {
    injectCuda(opts.cudaBinding);
    await resetBackend('cuda');
  }
}

export { listBackends, disposeBackends, BACKEND_NAMES } from './registry.js';
export type { BackendName, BackendStatus, BackendLimits, OpName } from './registry.js';
export { resolveKernel, computeLoss, computeLossCompact, lowerMasks } from './ops.js';
export type { Resolved, LossOptions, LossRun, LoweredMasks } from './ops.js';
export { timeKernels, type KernelTiming } from './profile.js';
