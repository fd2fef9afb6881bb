/**
 * Bench section: mask lowerings. For forests of N = 32k, 128k, 256k and 1M packed tokens (preorder prefixes of
 * one forest packed from the generator's agent rollouts), the build time of each lowering on each available
 * backend (median of a few runs, as called from JS: validation, kernel, read-back) with its ratio to the js
 * reference measured in the same run, the bytes of each lowering, and the fraction of attention work the
 * block-sparse mask skips against a dense causal mask. CUDA also reports its kernels' own time (cudaEvent, read
 * with timeKernels).
 */
import { performance } from 'node:perf_hooks';
import {
  bitsBytes,
  blockMaskBytes,
  denseBytes,
  TreepackError,
  validateTree,
  type BackendName,
  type BlockMask,
  type Sequences,
  type TreeArrays,
} from '../src/index.js';
import { listBackends, resolveKernel, timeKernels } from '../src/ops.js';
import { speed } from './format.js';

export const MASK_SIZES = [32_768, 131_072, 262_144, 1_048_576];

export interface MaskTiming {
  N: number;
  lowering: string;
  backend: BackendName;
  ms?: number; // median wall time
  kernelMs?: number; // CUDA: the kernels alone
  error?: string; // over a limit, or failed
  bytes: number;
}

export interface MaskSparsity {
  N: number;
  blockSize: number;
  causalBlocks: number; // query/kv block pairs a dense causal mask computes
  listedBlocks: number; // partial + full blocks of the tree mask
  fullBlocks: number;
  skippedFraction: number; // 1 - listed / causal
  visibleFraction: number; // visible pairs / causal pairs (the exact sparsity)
}

/** The first N nodes of a preorder forest are a preorder forest; subtrees are cut at N. */
function prefix(tree: TreeArrays, N: number): TreeArrays {
  const subtree_end = tree.subtree_end.slice(0, N);
  for (let p = 0; p < N; p++) if (subtree_end[p] > N) subtree_end[p] = N;
  return { parent: tree.parent.slice(0, N), subtree_end };
}

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)];
}

function sparsity(tree: TreeArrays, m: BlockMask): MaskSparsity {
  const N = tree.parent.length,
    nb = m.num_blocks;
  let listed = 0,
    full = 0;
  for (let i = 0; i < nb; i++) {
    listed += m.block_kv_num_blocks[i] + m.block_full_kv_num_blocks[i];
    full += m.block_full_kv_num_blocks[i];
  }
  let visible = 0;
  for (let k = 0; k < N; k++) visible += tree.subtree_end[k] - k;
  const causalBlocks = (nb * (nb + 1)) / 2;
  return {
    N,
    blockSize: m.block_size,
    causalBlocks,
    listedBlocks: listed,
    fullBlocks: full,
    skippedFraction: 1 - listed / causalBlocks,
    visibleFraction: visible / ((N * (N + 1)) / 2),
  };
}

type Lowering = {
  name: string;
  bytes: (N: number, out?: unknown) => number;
  run: (backend: BackendName, t: TreeArrays) => Promise<unknown>;
  maxN: number;
};

const LOWERINGS: Lowering[] = [
  ...[128, 64].map((B) => ({
    name: `block:${B}`,
    bytes: (N: number) => blockMaskBytes(N, B),
    run: async (b: BackendName, t: TreeArrays) => (await resolveKernel('maskBlocks', b)).kernel(t, B),
    maxN: Infinity,
  })),
  {
    name: 'slices',
    bytes: (_N, out) => (out as Int32Array | undefined)?.byteLength ?? NaN,
    run: async (b, t) => (await resolveKernel('maskSlices', b)).kernel(t),
    maxN: Infinity,
  },
  // Dense forms are quadratic: timed where they stay under a few hundred MB, sized everywhere.
  { name: 'bits', bytes: bitsBytes, run: async (b, t) => (await resolveKernel('maskBits', b)).kernel(t), maxN: 32_768 },
  { name: 'dense', bytes: denseBytes, run: async (b, t) => (await resolveKernel('maskDense', b)).kernel(t), maxN: 16_384 },
];

const OPS: Record<string, 'maskBlocks' | 'maskSlices' | 'maskBits' | 'maskDense'> = {
  'block:128': 'maskBlocks',
  'block:64': 'maskBlocks',
  slices: 'maskSlices',
  bits: 'maskBits',
  dense: 'maskDense',
};

/** Generator rollouts (pre-tokenized) packed into one forest of at least `N` nodes, on the best forest packer. */
async function generatorForest(N: number, samples: (groups: number) => Sequences): Promise<TreeArrays> {
  const pack = await resolveKernel('packForest', 'auto');
  for (let groups = Math.max(1, Math.ceil(N / 45_000)); ; groups += 2) {
    const forest = pack.kernel(samples(groups));
    if (forest.parent.length >= N) return forest;
  }
}

export async function benchMasks(
  quick: boolean,
  samples: (groups: number) => Sequences,
): Promise<{ timings: MaskTiming[]; sparsity: MaskSparsity[] }> {
  const reps = quick ? 3 : 7;
  const statuses = (await listBackends()).filter((s) => s.available);
  const full = await generatorForest(MASK_SIZES[MASK_SIZES.length - 1], samples);
  const timings: MaskTiming[] = [];
  const sparsities: MaskSparsity[] = [];
  const fmt = (x: number) => (x >= 100 ? x.toFixed(0) : x >= 10 ? x.toFixed(1) : x.toFixed(2));
  const mb = (x: number) => (Number.isFinite(x) ? `${(x / 2 ** 20).toFixed(x < 2 ** 20 ? 3 : 1)} MiB` : '-');

  console.log(
    `\n## mask lowerings (forest prefixes of ${full.parent.length.toLocaleString('en-US')} packed generator tokens; median of ${reps} runs; time as called from JS)`,
  );
  console.log(`  backends: ${statuses.map((s) => s.name).join(', ')}`);
  for (const N of MASK_SIZES) {
    const tree = prefix(full, N);
    const t0 = performance.now();
    validateTree(tree);
    console.log(`\n  N = ${N.toLocaleString('en-US')}: validation (every backend pays it) ${fmt(performance.now() - t0)} ms`);
    for (const low of LOWERINGS) {
      const rows: MaskTiming[] = [];
      let bytes = low.bytes(N);
      for (const s of statuses) {
        if (!s.ops.includes(OPS[low.name])) continue;
        const row: MaskTiming = { N, lowering: low.name, backend: s.name, bytes };
        if (N > low.maxN) {
          row.error = 'not timed (quadratic)';
        } else {
          try {
            const ms: number[] = [];
            const kernelMs: number[] = [];
            for (let r = 0; r < reps; r++) {
              const t = await timeKernels(() => low.run(s.name, tree));
              ms.push(t.wallMs);
              if (t.kernelMs !== undefined) kernelMs.push(t.kernelMs);
              if (low.name === 'slices') bytes = row.bytes = low.bytes(N, t.result);
              if (low.name === 'block:128' && s.name === 'js' && r === 0) sparsities.push(sparsity(tree, t.result as BlockMask));
            }
            row.ms = median(ms);
            if (kernelMs.length) row.kernelMs = median(kernelMs);
          } catch (err) {
            if (!(err instanceof TreepackError)) throw err;
            row.error = `${err.code}: ${err.message.split(';')[0]}`;
          }
        }
        rows.push(row);
      }
      const js = rows.find((r) => r.backend === 'js')?.ms;
      console.log(`    ${low.name.padEnd(9)} ${mb(bytes).padStart(12)}`);
      for (const r of rows) {
        const detail =
          r.ms === undefined
            ? r.error
            : `${fmt(r.ms)} ms${js && r.backend !== 'js' ? ` (${speed(js, r.ms)} than js)` : ''}${r.kernelMs !== undefined ? `, kernels ${r.kernelMs.toFixed(3)} ms` : ''}`;
        console.log(`      ${r.backend.padEnd(7)} ${detail}`);
      }
      timings.push(...rows);
    }
  }
  console.log('\n  block-sparse (B = 128) vs dense causal, same forests:');
  for (const s of sparsities) {
    console.log(
      `    N = ${s.N.toLocaleString('en-US').padStart(9)}: ${s.listedBlocks} of ${s.causalBlocks} causal blocks computed (${s.fullBlocks} full), ${(100 * s.skippedFraction).toFixed(2)}% skipped; visible pairs ${(100 * s.visibleFraction).toFixed(2)}% of causal`,
    );
  }
  return { timings, sparsity: sparsities };
}
