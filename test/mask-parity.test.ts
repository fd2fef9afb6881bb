/**
 * Every mask lowering on every available backend equals the js reference, element for element: the small forests
 * and edge cases, packed agent-shaped batches, and random forests up to N = 256k. Sizes per backend: the block
 * mask up to 256k everywhere; the dense forms (quadratic) up to 4096 tokens on cpu and cuda and 2048 on webgpu
 * (the Mesa GL software adapter here, llvmpipe on 2 cores), so the suite stays at a few minutes.
 * Unavailable backends are reported with their reason (test/helpers/backends.ts), and fail where the environment
 * requires them (TREEPACK_REQUIRE_*).
 */
import { describe, expect, it } from 'vitest';
import { listBackends, resolveKernel, type BackendName, type OpName } from '../src/backend/index.js';
import { cudaDeviceInfo, loadCuda, loadNative } from '../src/backend/native.js';
import { TreepackError } from '../src/errors.js';
import { maskBlocks } from '../src/mask/blocks.js';
import { maskCuSeqlens } from '../src/mask/cuseqlens.js';
import { maskBits, maskDense } from '../src/mask/dense.js';
import { maskSlices } from '../src/mask/slices.js';
import type { TreeArrays } from '../src/mask/types.js';
import { packForest } from '../src/pack/forest.js';
import { describeBackends } from './helpers/backends.js';
import { caught } from './helpers/errors.js';
import { agentBatch } from './helpers/sequences.js';
import { packed, randomTree, smallForests } from './helpers/trees.js';

const statuses = await listBackends();

/** Largest N per lowering each backend is tested at (see the header). */
const SIZES: Record<Exclude<BackendName, 'js'>, { dense: number; blocks: number }> = {
  cpu: { dense: 4096, blocks: 1 << 18 },
  webgpu: { dense: 2048, blocks: 1 << 18 },
  cuda: { dense: 4096, blocks: 1 << 18 },
};

function largeForests(maxN: number): [string, TreeArrays][] {
  const out: [string, TreeArrays][] = [];
  for (const N of [1000, 4096, 1 << 16, 1 << 18]) {
    if (N > maxN) continue;
    out.push([`random forest N=${N}`, randomTree(N, N, { pop: 0.2, root: 0.0005 })]);
    out.push([`deep forest N=${N}`, randomTree(N + 1, N, { pop: 0.002, root: 0 })]);
    out.push([`wide forest N=${N}`, randomTree(N + 2, N, { pop: 0.9, root: 0.001 })]);
  }
  if (maxN >= 1 << 18) {
    // Agent-shaped: groups share a prompt, requests extend each other; about 150k nodes from 1.3M naive tokens.
    out.push(['agent batch', packForest(agentBatch(5, { groups: 4, episodes: 8, turns: 12, prompt: 3000, step: 300 }))]);
    out.push(['one sequence of 200k tokens', packed([Array.from({ length: 200_000 }, (_, i) => i % 97)])]);
  }
  return out;
}

/** Element-for-element equality of typed arrays (and objects of them) without a deep diff of megabyte arrays. */
function same(actual: unknown, expected: unknown, path = 'result'): void {
  if (ArrayBuffer.isView(expected)) {
    expect(actual?.constructor, path).toBe(expected.constructor);
    const a = Buffer.from((actual as Int32Array).buffer, (actual as Int32Array).byteOffset, (actual as Int32Array).byteLength);
    const e = Buffer.from(expected.buffer, expected.byteOffset, expected.byteLength);
    if (!a.equals(e)) {
      const i = a.length !== e.length ? -1 : a.findIndex((x, k) => x !== e[k]);
      expect.fail(`${path}: ${a.length} vs ${e.length} bytes, first difference at byte ${i}`);
    }
  } else if (expected !== null && typeof expected === 'object') {
    expect(Object.keys(actual as object).sort(), path).toEqual(Object.keys(expected).sort());
    for (const [k, v] of Object.entries(expected)) same((actual as Record<string, unknown>)[k], v, `${path}.${k}`);
  } else {
    expect(actual, path).toBe(expected);
  }
}

const MASK_OPS: OpName[] = ['maskDense', 'maskBits', 'maskBlocks', 'maskSlices', 'maskCuSeqlens'];

await describeBackends(
  MASK_OPS,
  (name, status) => {
    const has = (op: OpName) => status.ops.includes(op);
    const run = async <K extends 'maskDense' | 'maskBits' | 'maskSlices' | 'maskCuSeqlens'>(op: K, t: TreeArrays) =>
      (await resolveKernel(op, name)).kernel(t);
    const size = SIZES[name as Exclude<BackendName, 'js'>];

    describe(`mask parity: ${name} equals js`, () => {
      for (const [label, tree] of [...smallForests(), ...largeForests(size.blocks)]) {
        const N = tree.parent.length;
        it(label, { timeout: 60_000 }, async () => {
          if (has('maskBlocks')) {
            const blocks = (await resolveKernel('maskBlocks', name)).kernel;
            for (const B of N <= 512 ? [1, 3, 64, 128] : [64, 128]) same(await blocks(tree, B), maskBlocks(tree, B));
          }
          if (N <= size.dense) {
            if (has('maskDense')) same(await run('maskDense', tree), maskDense(tree));
            if (has('maskBits')) same(await run('maskBits', tree), maskBits(tree));
          }
          if (has('maskSlices')) same(await run('maskSlices', tree), maskSlices(tree));
          if (has('maskCuSeqlens')) {
            const ref = (() => {
              try {
                return maskCuSeqlens(tree);
              } catch (e) {
                return e;
              }
            })();
            if (ref instanceof TreepackError) await expect(run('maskCuSeqlens', tree)).rejects.toMatchObject({ code: 'E_INPUT' });
            else same(await run('maskCuSeqlens', tree), ref);
          }
        });
      }

      it('bad input: the same clear errors as js', async () => {
        const bad = { parent: Int32Array.from([-1, 0, -1]), subtree_end: Int32Array.from([3, 2, 3]) };
        for (const op of status.ops.filter(
          (o): o is 'maskDense' | 'maskBits' | 'maskSlices' | 'maskCuSeqlens' => o.startsWith('mask') && o !== 'maskBlocks',
        )) {
          await expect(run(op, bad)).rejects.toMatchObject({
            code: 'E_INPUT',
            message: expect.stringMatching(/subtree_end\[0\] = 3: expected 2/),
          });
        }
        if (has('maskBlocks'))
          await expect((await resolveKernel('maskBlocks', name)).kernel(bad, 0)).rejects.toMatchObject({
            code: expect.stringMatching(/E_INPUT|E_ARG/),
          });
      });
    });
  },
  { againstJs: true },
);

describe('mask backends: limits and fallback', () => {
  it('webgpu refuses outputs over its storage-buffer limit with E_LIMIT, before allocating', async (ctx) => {
    const webgpu = statuses.find((s) => s.name === 'webgpu')!;
    if (!webgpu.available) return ctx.skip(`webgpu unavailable: ${webgpu.detail}`);
    const tree = randomTree(1, 100_000, { pop: 0.3 });
    const blocks = (await resolveKernel('maskBlocks', 'webgpu')).kernel;
    await expect(blocks(tree, 16)).rejects.toMatchObject({
      code: 'E_LIMIT',
      message: expect.stringMatching(/block mask index array for N = 100000 needs 156250000 bytes, over the webgpu storage-buffer/),
    });
    await expect((await resolveKernel('maskDense', 'webgpu')).kernel(tree)).rejects.toMatchObject({ code: 'E_LIMIT' });
  });

  it('an unavailable backend is refused with its reason when named, and never crashes the process', async () => {
    for (const s of statuses.filter((b) => !b.available)) {
      await expect(resolveKernel('maskBlocks', s.name)).rejects.toMatchObject({
        code: 'E_BACKEND',
        message: expect.stringContaining(s.detail),
      });
    }
  });

  it('the CUDA addon, when built, loads without a GPU and its kernels answer with the CUDA error', (ctx) => {
    const cuda = loadCuda();
    if ('error' in cuda) return ctx.skip(`CUDA addon not loaded: ${cuda.error}`);
    if (cudaDeviceInfo().available) return ctx.skip('a GPU is present (this checks the no-device answer)');
    const err = caught(() => cuda.binding.maskBlocks(randomTree(1, 100).subtree_end, 64)) as TreepackError;
    expect(err).toBeInstanceOf(TreepackError);
    expect(err.code).toBe('E_BACKEND');
    expect(err.message).toMatch(/^CUDA error \d+: /);
  });

  it('the C ABI refuses out-of-range trees even when TS validation is bypassed', (ctx) => {
    const native = loadNative();
    if ('error' in native) return ctx.skip(`native addon not loaded: ${native.error}`);
    for (const call of [
      () => native.binding.maskBlocks(Int32Array.from([5, 2]), 64),
      () => native.binding.maskSlices(Int32Array.from([-1, 3]), Int32Array.from([2, 2])),
      () => native.binding.maskDense(Int32Array.from([0]), Int32Array.from([1])),
    ]) {
      const err = caught(call) as TreepackError;
      expect(err).toBeInstanceOf(TreepackError);
      expect(err.code).toBe('E_INPUT');
      expect(err.message).toMatch(/not a packed forest/);
    }
  });

  it('auto resolution reports what it skipped and falls back to a backend that has the op', async () => {
    const r = await resolveKernel('maskSlices');
    expect(['cpu', 'js']).toContain(r.backend);
    expect(r.report).toMatch(/^maskSlices on (cpu|js): .*skipped cuda: /);
    const tree = randomTree(2, 500);
    expect(await r.kernel(tree)).toEqual(maskSlices(tree));
  });
});
