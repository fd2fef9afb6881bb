/** Registers the built-in backends. Importing this module is what makes them resolvable. */
import { packForest } from '../pack/forest.js';
import { loadNative, packForestNative } from './native.js';
import { registerBackend, registerKernel } from './registry.js';

registerBackend('js', 0, () => 'TypeScript reference');
registerKernel('js', 'packForest', packForest);

registerBackend('cpu', 10, () => {
  const loaded = loadNative();
  if ('error' in loaded) throw new Error(`native addon not loaded: ${loaded.error}`);
  return `native addon ${loaded.path}`;
});
registerKernel('cpu', 'packForest', (seqs) => packForestNative(seqs));

export { listBackends, resolveKernel, BACKEND_NAMES } from './registry.js';
export type { BackendName, BackendStatus, Resolved } from './registry.js';
