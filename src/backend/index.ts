/** Registers the built-in backends. Importing this module is what makes them resolvable. */
import { TreepackError } from '../errors.js';
import { lossCompactReference, lossReference } from '../loss/reference.js';
import { maskBlocks } from '../mask/blocks.js';
import { maskCuSeqlens } from '../mask/cuseqlens.js';
import { maskBits, maskDense } from '../mask/dense.js';
import { maskSlices } from '../mask/slices.js';
import { packForest } from '../pack/forest.js';
import { addonLoss, addonLossCompact, type LossAddon } from './loss-addon.js';
import { maskBitsCuda, maskBlocksCudaTimed, maskDenseCuda } from './mask-cuda.js';
import { maskBitsCpu, maskBlocksCpu, maskCuSeqlensCpu, maskDenseCpu, maskSlicesCpu } from './mask-cpu.js';
import { cudaDeviceInfo, loadCuda, loadNative, packForestNative, type Loaded } from './native.js';
import { webgpuContext } from './webgpu/device.js';
import { lossCompactWebGPU, lossWebGPU } from './webgpu/loss.js';
import { maskBitsWebGPU, maskBlocksWebGPU, maskDenseWebGPU } from './webgpu/mask.js';
import { registerBackend, registerKernel } from './registry.js';

registerBackend('js', 0, () => 'TypeScript reference');
registerKernel('js', 'packForest', packForest);
registerKernel('js', 'maskDense', async (t) => maskDense(t));
registerKernel('js', 'maskBits', async (t) => maskBits(t));
registerKernel('js', 'maskBlocks', async (t, b) => maskBlocks(t, b));
registerKernel('js', 'maskSlices', async (t) => maskSlices(t));
registerKernel('js', 'maskCuSeqlens', async (t) => maskCuSeqlens(t));
registerKernel('js', 'loss', async (b, lp, cfg) => lossReference(b, lp, cfg));
registerKernel('js', 'lossCompact', async (plan, lp, cfg) => lossCompactReference(plan, lp, cfg));

function addon(loaded: Loaded<LossAddon>, name: string): LossAddon {
  if ('error' in loaded) throw new TreepackError('E_BACKEND', `${name} addon unavailable: ${loaded.error}`);
  return loaded.binding;
}

registerBackend('cpu', 10, () => {
  const loaded = loadNative();
  if ('error' in loaded) throw new Error(`native addon not loaded: ${loaded.error}`);
  return `native addon ${loaded.path}`;
});
registerKernel('cpu', 'packForest', (seqs) => packForestNative(seqs));
registerKernel('cpu', 'maskDense', async (t) => maskDenseCpu(t));
registerKernel('cpu', 'maskBits', async (t) => maskBitsCpu(t));
registerKernel('cpu', 'maskBlocks', async (t, b) => maskBlocksCpu(t, b));
registerKernel('cpu', 'maskSlices', async (t) => maskSlicesCpu(t));
registerKernel('cpu', 'maskCuSeqlens', async (t) => maskCuSeqlensCpu(t));
registerKernel('cpu', 'loss', async (b, lp, cfg) => addonLoss(addon(loadNative(), 'native'), b, lp, cfg));
registerKernel('cpu', 'lossCompact', async (plan, lp, cfg) => addonLossCompact(addon(loadNative(), 'native'), plan, lp, cfg));

// GPU backends: registered so that `listBackends()` says whether each can run here and why not; each kernel
// registers beside its backend.
registerBackend('cuda', 30, () => {
  const info = cudaDeviceInfo();
  if (!info.available) throw new Error(info.reason);
  return info.devices.map((d) => `${d.name} (sm_${d.major}${d.minor})`).join(', ');
});
registerKernel('cuda', 'maskDense', async (t) => maskDenseCuda(t));
registerKernel('cuda', 'maskBits', async (t) => maskBitsCuda(t));
registerKernel('cuda', 'maskBlocks', async (t, b) => maskBlocksCudaTimed(t, b).mask);
registerKernel('cuda', 'loss', async (b, lp, cfg) => addonLoss(addon(loadCuda(), 'CUDA'), b, lp, cfg));
registerKernel('cuda', 'lossCompact', async (plan, lp, cfg) => addonLossCompact(addon(loadCuda(), 'CUDA'), plan, lp, cfg));

registerBackend('webgpu', 20, async () => {
  const r = await webgpuContext();
  if (!r.ok) throw new Error(r.reason);
  return `${r.ctx.description} via Dawn ${r.ctx.backend}${r.ctx.isFallbackAdapter ? ' (software adapter)' : ''}`;
});
// Slices and cu_seqlens are one sequential O(N) walk of the tree whose output the trainer consumes on the host:
// GPU backends leave them to cpu/js.
registerKernel('webgpu', 'maskDense', maskDenseWebGPU);
registerKernel('webgpu', 'maskBits', maskBitsWebGPU);
registerKernel('webgpu', 'maskBlocks', maskBlocksWebGPU);
registerKernel('webgpu', 'loss', lossWebGPU);
registerKernel('webgpu', 'lossCompact', lossCompactWebGPU);

export { listBackends, resolveKernel, BACKEND_NAMES } from './registry.js';
export type { BackendName, BackendStatus, Resolved } from './registry.js';
