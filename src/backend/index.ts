/** Registers the built-in backends. Importing this module is what makes them resolvable. */
import { TreepackError } from '../errors.js';
import { lossCompactReference, lossReference } from '../loss/reference.js';
import { packForest } from '../pack/forest.js';
import { addonLoss, addonLossCompact, type LossAddon } from './loss_addon.js';
import { cudaDeviceInfo, loadCuda, loadNative, packForestNative, type Loaded } from './native.js';
import { webgpuContext } from './webgpu/device.js';
import { lossWebGPU } from './webgpu/loss.js';
import { registerBackend, registerKernel } from './registry.js';

registerBackend('js', 0, () => 'TypeScript reference');
registerKernel('js', 'packForest', packForest);
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
registerKernel('cpu', 'loss', async (b, lp, cfg) => addonLoss(addon(loadNative(), 'native'), b, lp, cfg));
registerKernel('cpu', 'lossCompact', async (plan, lp, cfg) => addonLossCompact(addon(loadNative(), 'native'), plan, lp, cfg));

// GPU backends: registered so that `listBackends()` says whether each can run here and why not; their kernels
// register beside them as the mask and loss steps add them.
registerBackend('cuda', 30, () => {
  const info = cudaDeviceInfo();
  if (!info.available) throw new Error(info.reason);
  return info.devices.map((d) => `${d.name} (sm_${d.major}${d.minor})`).join(', ');
});
registerKernel('cuda', 'loss', async (b, lp, cfg) => addonLoss(addon(loadCuda(), 'CUDA'), b, lp, cfg));
registerKernel('cuda', 'lossCompact', async (plan, lp, cfg) => addonLossCompact(addon(loadCuda(), 'CUDA'), plan, lp, cfg));

registerBackend('webgpu', 20, async () => {
  const r = await webgpuContext();
  if (!r.ok) throw new Error(r.reason);
  return `${r.ctx.description} via Dawn ${r.ctx.backend}${r.ctx.isFallbackAdapter ? ' (software adapter)' : ''}`;
});
registerKernel('webgpu', 'loss', lossWebGPU);

export { listBackends, resolveKernel, BACKEND_NAMES } from './registry.js';
export type { BackendName, BackendStatus, Resolved } from './registry.js';
