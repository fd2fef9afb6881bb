/** The backend registry: what gets chosen, what is reported, and that explicit choices are honoured or refused. */
import { afterAll, describe, expect, it } from 'vitest';
import { disposeBackends, listBackends, resolveKernel } from '../src/backend/index.js';
import { loadNative } from '../src/backend/native.js';
import { registerBackend, registerKernel } from '../src/backend/registry.js';
import { TreepackError } from '../src/errors.js';
import { packForest } from '../src/pack/forest.js';
import { caught } from './helpers/errors.js';
import { csr } from './helpers/sequences.js';

afterAll(disposeBackends);

describe('backend registry', () => {
  const nativeBuilt = !('error' in loadNative());

  it('reports every backend with a reason, in priority order', async () => {
    const list = await listBackends();
    expect(list.map((b) => b.name)).toEqual(['cuda', 'webgpu', 'cpu', 'js']);
    for (const b of list) expect(b.detail.length).toBeGreaterThan(0);
    expect(list.find((b) => b.name === 'js')!.available).toBe(true);
    expect(list.find((b) => b.name === 'cpu')!.available).toBe(nativeBuilt);
    expect(list.find((b) => b.name === 'cpu')!.ops).toContain('packForest');
  });

  it('auto picks the highest-priority backend that has the op, and says what it skipped', async () => {
    const r = await resolveKernel('packForest');
    expect(r.backend).toBe(nativeBuilt ? 'cpu' : 'js');
    expect(r.report).toMatch(/skipped cuda: no 'packForest' kernel; webgpu: no 'packForest' kernel/);
    const seqs = csr([[1, 2, 3], [1, 2], [4]]);
    expect(r.kernel(seqs)).toEqual(packForest(seqs));
  });

  it('auto never prefers a software WebGPU adapter over the C++ core, and says why; named, it runs as asked', async (ctx) => {
    const webgpu = (await listBackends()).find((b) => b.name === 'webgpu')!;
    if (!webgpu.available) return ctx.skip(`webgpu unavailable: ${webgpu.detail}`);
    if (!/software adapter/.test(webgpu.detail)) return ctx.skip(`a hardware adapter: ${webgpu.detail}`);
    const r = await resolveKernel('maskBlocks');
    expect(r.backend).toBe(nativeBuilt ? 'cpu' : 'webgpu');
    if (nativeBuilt)
      expect(r.report).toMatch(/skipped cuda: .*; webgpu: .*\(software adapter\), emulated in software, slower than the C\+\+ core\)$/);
    expect((await resolveKernel('maskBlocks', 'webgpu')).backend).toBe('webgpu');
  });

  it('honours an explicit backend, and refuses one that cannot run the op', async () => {
    expect((await resolveKernel('packForest', 'js')).backend).toBe('js');
    await expect(resolveKernel('packForest', 'webgpu')).rejects.toThrow(
      /no available backend for 'packForest': webgpu: no 'packForest' kernel/,
    );
    const err = await resolveKernel('packForest', 'tpu' as never).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(TreepackError);
    expect((err as TreepackError).code).toBe('E_ARG');
  });

  it('refuses duplicate registrations', () => {
    expect((caught(() => registerBackend({ name: 'js', priority: 0, init: () => 'again' })) as TreepackError).code).toBe('E_BACKEND');
    expect(() => registerKernel('js', 'packForest', packForest)).toThrow(/already registered for backend 'js'/);
  });
});
