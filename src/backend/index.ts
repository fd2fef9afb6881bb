/** Registers the built-in backends. Importing this module is what makes them resolvable. */
import { packForest } from '../pack/forest.js';
import { cudaDeviceInfo, loadNative, packForestNative } from './native.js';
import { webgpuContext } from './webgpu/device.js';
import { registerBackend, registerKernel } from './registry.js';

registerBackend('js', 0, () => 'TypeScript reference');
registerKernel('js', 'packForest', packForest);

registerBackend('cpu', 10, () => {
  const loaded = loadNative();
  if ('error' in loaded) throw new Error(`native addon not loaded: ${loaded.error}`);
  return `native addon ${loaded.path}`;
});
registerKernel('cpu', 'packForest', (seqs) => packForestNative(seqs));

// GPU backends: registered so that `listBackends()` says whether each can run here and why not; their kernels
// register beside them as the mask and loss steps add them.
registerBackend('cuda', 30, () => {
  const info = cudaDeviceInfo();
  if (!info.available) throw new Error(info.reason);
  return info.devices.map((d) => `${d.name} (sm_${d.major}${d.minor})`).join(', ');
});

registerBackend('webgpu', 20, async () => {
  const r = await webgpuContext();
  if (!r.ok) throw new Error(r.reason);
  return `${r.ctx.description} via Dawn ${r.ctx.backend}${r.ctx.isFallbackAdapter ? ' (software adapter)' : ''}`;
});

export { listBackends, resolveKernel, BACKEND_NAMES } from './registry.js';
export type { BackendName, BackendStatus, Resolved } from './registry.js';
