/**
 * Binding injection (better-sqlite3's `nativeBinding`): configureBackends takes a trainer's own build of the CPU or
 * CUDA addon, as a path or as a loaded object, ahead of the environment variables; a binding that is not a treepack
 * addon of this ABI is refused naming the option, and the previous one stays in use.
 */
import { copyFileSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { ABI_HASH } from '../src/backend/abi.js';
import { computeLoss, configureBackends, disposeBackends, listBackends, resolveKernel, timeKernels } from '../src/backend/index.js';
import { loadNative, type CudaBinding, type NativeBinding } from '../src/backend/native.js';
import { TreepackError } from '../src/errors.js';
import { maskBlocks } from '../src/mask/blocks.js';
import { maskDense } from '../src/mask/dense.js';
import { lossReference } from '../src/loss/reference.js';
import { resolveLossConfig } from '../src/loss/config.js';
import { close, randomLossCase } from './helpers/loss.js';
import { randomBatch } from './helpers/sequences.js';
import { randomTree } from './helpers/trees.js';

afterAll(disposeBackends);

const native = loadNative();
const skip = 'error' in native ? native.error : '';
if (skip) console.log(`binding injection tests skipped: ${skip}`);
const dir = mkdtempSync(path.join(tmpdir(), 'treepack-binding-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

async function cpuDetail(): Promise<string> {
  return (await listBackends()).find((b) => b.name === 'cpu')!.detail;
}

describe.skipIf(skip !== '')(`configureBackends${skip ? ` (skipped: ${skip})` : ''}`, () => {
  const real = (native as { binding: NativeBinding; path: string }).binding;

  it('loads the CPU addon from a given path, ahead of TREEPACK_NATIVE_BINDING', async () => {
    const copy = path.join(dir, 'my-treepack.node');
    copyFileSync((native as { path: string }).path, copy);
    process.env.TREEPACK_NATIVE_BINDING = path.join(dir, 'absent.node');
    try {
      await configureBackends({ nativeBinding: copy });
      expect(await cpuDetail()).toBe(`native addon ${copy}`);
      const k = await resolveKernel('packForest', 'cpu');
      expect(k.kernel({ tokens: Int32Array.from([1, 2, 1, 3]), offsets: Int32Array.from([0, 2, 4]) }).input_ids).toEqual(
        Int32Array.from([1, 2, 3]),
      );
    } finally {
      delete process.env.TREEPACK_NATIVE_BINDING;
    }
  });

  it('uses a loaded addon object as given', async () => {
    let calls = 0;
    const wrapped: NativeBinding = { ...real, loss: (...args: Parameters<NativeBinding['loss']>) => (calls++, real.loss(...args)) };
    await configureBackends({ nativeBinding: wrapped });
    const { batch, lp } = randomLossCase(randomBatch(1, { count: 10 }), 1);
    const r = await computeLoss(batch, lp, {}, { backend: 'cpu' });
    expect(calls).toBe(1);
    close(r.loss, lossReference(batch, lp, resolveLossConfig({})).loss, 1e-6, 'loss');
    expect(await cpuDetail()).toBe('native addon the given object');
  });

  it('refuses what is not a treepack addon of this ABI, naming the option, and keeps the previous one', async () => {
    const before = await cpuDetail();
    const cases: [unknown, RegExp][] = [
      [path.join(dir, 'nothing-here.node'), /nativeBinding: .*nothing-here\.node is not a usable treepack addon/],
      [{ packForest() {} }, /missing maskDense, .*abi, init/],
      [{ ...real, abi: () => 'deadbeef' }, new RegExp(`built from other ABI tables \\(deadbeef, this package has ${ABI_HASH}\\)`)],
      [42, /not an addon object/],
    ];
    for (const [binding, message] of cases) {
      const err = await configureBackends({ nativeBinding: binding as NativeBinding }).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(TreepackError);
      expect((err as TreepackError).code).toBe('E_ARG');
      expect((err as TreepackError).where.field).toBe('nativeBinding');
      expect((err as TreepackError).message).toMatch(message);
    }
    expect(await cpuDetail()).toBe(before);
  });

  it('takes a CUDA addon object: the cuda backend then runs through it (a stand-in forwarding to the CPU addon), its kernel times reach timeKernels', async () => {
    // What the JS glue of the cuda backend does with a binding (device info, limits, dispatch) is tested here; the
    // CUDA kernels themselves need a GPU (test/loss.test.ts and test/mask-parity.test.ts run them there).
    // Each lowering reports its own kernel time, as the CUDA addon's cudaEvents would.
    const timed = <T>(data: T, kernelMs: number) => ({ data, kernelMs });
    const standIn: CudaBinding = {
      deviceInfo: () => ({
        code: 0,
        message: 'no error',
        runtimeVersion: 13000,
        driverVersion: 13000,
        devices: [{ name: 'Stand-in GPU', major: 9, minor: 0, totalGlobalMem: 80e9, multiProcessorCount: 132 }],
      }),
      gatherI32: (src, idx) => Int32Array.from(idx, (i) => src[i] ?? 0),
      maskDense: (parent, se) => timed(real.maskDense(parent, se), 0.25),
      maskBits: (parent, se) => timed(real.maskBits(parent, se), 0.5),
      maskBlocks: (se, B) => timed(real.maskBlocks(se, B), 1.5),
      loss: real.loss.bind(real),
      lossCompact: real.lossCompact.bind(real),
      version: real.version.bind(real),
      abi: real.abi.bind(real),
      init: real.init.bind(real),
    };
    await configureBackends({ cudaBinding: standIn });
    const cuda = (await listBackends()).find((b) => b.name === 'cuda')!;
    expect(cuda).toMatchObject({ available: true, detail: 'Stand-in GPU (sm_90)', limits: { maxArrayBytes: 2 ** 31 } });
    const tree = randomTree(3, 300);
    const k = await resolveKernel('maskBlocks');
    expect(k.backend).toBe('cuda');
    expect(await k.kernel(tree, 16)).toEqual(maskBlocks(tree, 16));
    await expect(k.kernel({ parent: tree.parent, subtree_end: tree.subtree_end.map((e) => e + 1) }, 16)).rejects.toMatchObject({
      code: 'E_INPUT',
    });
    const { batch, lp } = randomLossCase(randomBatch(2, { count: 10 }), 2);
    const r = await computeLoss(batch, lp, { kl: 'k3', kl_coef: 0.1 }, { backend: 'cuda' });
    close(r.loss, lossReference(batch, lp, resolveLossConfig({ kl: 'k3', kl_coef: 0.1 })).loss, 1e-6, 'loss via the cuda glue');

    // timeKernels adds up the kernel times reported inside its call only, also when timed calls overlap; a call
    // whose kernels report none (js, and every loss) has no kernelMs.
    const dense = await resolveKernel('maskDense', 'cuda');
    const both = await timeKernels(async () => [await k.kernel(tree, 16), await dense.kernel(tree)]);
    expect(both.result[1]).toEqual(maskDense(tree));
    expect(both.kernelMs).toBe(1.75);
    expect(both.wallMs).toBeGreaterThan(0);
    const bits = await resolveKernel('maskBits', 'cuda');
    const [a, b] = await Promise.all([
      timeKernels(() => k.kernel(tree, 8)),
      timeKernels(async () => [await bits.kernel(tree), await bits.kernel(tree)]),
    ]);
    expect([a.kernelMs, b.kernelMs]).toEqual([1.5, 1]);
    const js = await resolveKernel('maskBlocks', 'js');
    expect(await timeKernels(() => js.kernel(tree, 16))).not.toHaveProperty('kernelMs');
    expect(await timeKernels(() => computeLoss(batch, lp, {}, { backend: 'cuda' }))).not.toHaveProperty('kernelMs');
  });
});
