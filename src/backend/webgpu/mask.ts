/**
 * The mask lowerings on WebGPU (kernels in mask.wgsl.ts), read back into typed arrays equal to the js reference's.
 * Input is checked, and outputs sized against the device's binding limit (the webgpu entry's limits: the Mesa GL
 * software adapter binds at most 128 MiB per storage buffer), by the dispatch layer (src/backend/ops.ts).
 */
import { TreepackError } from '../../errors.js';
import { bitsWordsPerRow, numBlocks } from '../../mask/sizes.js';
import type { BlockMask, TreeArrays } from '../../mask/types.js';
import { webgpuContext, type WebGPUContext } from './device.js';
import { BITS_WGSL, BLOCK_ENDS_WGSL, BLOCK_ROWS_WGSL, DENSE_WGSL, WORKGROUP_SIZE } from './mask.wgsl.js';

async function context(): Promise<WebGPUContext> {
  const r = await webgpuContext();
  if (!r.ok) throw new TreepackError('E_BACKEND', `webgpu backend unavailable: ${r.reason}`);
  return r.ctx;
}

const pipelines = new WeakMap<GPUDevice, Map<string, GPUComputePipeline>>();

function pipeline(device: GPUDevice, code: string): GPUComputePipeline {
  let cache = pipelines.get(device);
  if (!cache) pipelines.set(device, (cache = new Map<string, GPUComputePipeline>()));
  let p = cache.get(code);
  if (!p) {
    p = device.createComputePipeline({ layout: 'auto', compute: { module: device.createShaderModule({ code }), entryPoint: 'main' } });
    cache.set(code, p);
  }
  return p;
}

/** Storage buffers are at least 4 bytes (an empty binding is invalid) and a multiple of 4. */
function storage(device: GPUDevice, bytes: number, data?: Int32Array): GPUBuffer {
  const size = Math.max(4, Math.ceil(bytes / 4) * 4);
  const buf = device.createBuffer({ size, usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST });
  if (data && data.byteLength > 0) device.queue.writeBuffer(buf, 0, data.buffer, data.byteOffset, data.byteLength);
  return buf;
}

function params(device: GPUDevice, n: number, block: number, nb: number, width: number): GPUBuffer {
  const buf = device.createBuffer({ size: 16, usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST });
  device.queue.writeBuffer(buf, 0, new Uint32Array([n, block, nb, width]));
  return buf;
}

function dispatch(device: GPUDevice, pass: GPUComputePassEncoder, code: string, buffers: GPUBuffer[], invocations: number): void {
  const p = pipeline(device, code);
  pass.setPipeline(p);
  pass.setBindGroup(
    0,
    device.createBindGroup({
      layout: p.getBindGroupLayout(0),
      entries: buffers.map((buffer, binding) => ({ binding, resource: { buffer } })),
    }),
  );
  const groups = Math.ceil(invocations / WORKGROUP_SIZE);
  const maxX = device.limits.maxComputeWorkgroupsPerDimension;
  const x = Math.max(1, Math.min(groups, maxX));
  pass.dispatchWorkgroups(x, Math.max(1, Math.ceil(groups / x)));
}

interface Job {
  encode: (pass: GPUComputePassEncoder) => void;
  outputs: [GPUBuffer, number][]; // buffers to read back, and how many bytes of each
  owned: GPUBuffer[]; // destroyed afterwards
}

/**
 * Creates the job's buffers, runs its passes, then copies its outputs into mappable buffers and reads them back.
 * Allocation, pipeline and bind-group errors surface through error scopes, not as exceptions.
 */
async function run(device: GPUDevice, build: () => Job): Promise<ArrayBuffer[]> {
  device.pushErrorScope('validation');
  device.pushErrorScope('out-of-memory');
  const { encode, outputs, owned } = build();
  const enc = device.createCommandEncoder();
  const pass = enc.beginComputePass();
  encode(pass);
  pass.end();
  const reads = outputs.map(([buf]) => device.createBuffer({ size: buf.size, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST }));
  outputs.forEach(([buf], i) => enc.copyBufferToBuffer(buf, 0, reads[i], 0, buf.size));
  device.queue.submit([enc.finish()]);
  const oom = await device.popErrorScope();
  const invalid = await device.popErrorScope();
  try {
    if (oom || invalid) throw new TreepackError('E_BACKEND', `webgpu mask kernel failed: ${(oom ?? invalid)!.message}`);
    return await Promise.all(
      reads.map(async (r, i) => {
        await r.mapAsync(GPUMapMode.READ);
        // Mapped ranges come in multiples of 4 bytes; the dense mask may end mid-word.
        const copy = r.getMappedRange().slice(0, outputs[i][1]);
        r.unmap();
        return copy;
      }),
    );
  } finally {
    for (const b of [...reads, ...owned]) b.destroy();
  }
}

export async function maskDenseWebGPU(tree: TreeArrays): Promise<Uint8Array> {
  const N = tree.parent.length;
  const { device } = await context();
  const words = Math.ceil((N * N) / 4);
  const [bytes] = await run(device, () => {
    const se = storage(device, 4 * N, tree.subtree_end),
      out = storage(device, 4 * words),
      P = params(device, N, 0, 0, words);
    return { encode: (pass) => dispatch(device, pass, DENSE_WGSL, [P, se, out], words), outputs: [[out, N * N]], owned: [se, out, P] };
  });
  return new Uint8Array(bytes);
}

export async function maskBitsWebGPU(tree: TreeArrays): Promise<Uint32Array> {
  const N = tree.parent.length;
  const { device } = await context();
  const W = bitsWordsPerRow(N);
  const [bytes] = await run(device, () => {
    const se = storage(device, 4 * N, tree.subtree_end),
      out = storage(device, 4 * N * W),
      P = params(device, N, 0, 0, W);
    return { encode: (pass) => dispatch(device, pass, BITS_WGSL, [P, se, out], N * W), outputs: [[out, 4 * N * W]], owned: [se, out, P] };
  });
  return new Uint32Array(bytes);
}

export async function maskBlocksWebGPU(tree: TreeArrays, B: number): Promise<BlockMask> {
  const N = tree.parent.length;
  const { device } = await context();
  const nb = numBlocks(N, B);
  const [numBytes, kvBytes, fullBytes] = await run(device, () => {
    const se = storage(device, 4 * N, tree.subtree_end),
      ends = storage(device, 8 * nb),
      nums = storage(device, 8 * nb);
    const kvIdx = storage(device, 4 * nb * nb),
      fullIdx = storage(device, 4 * nb * nb),
      P = params(device, N, B, nb, 0);
    return {
      encode: (pass) => {
        dispatch(device, pass, BLOCK_ENDS_WGSL, [P, se, ends], nb);
        dispatch(device, pass, BLOCK_ROWS_WGSL, [P, ends, nums, kvIdx, fullIdx], nb);
      },
      outputs: [
        [nums, 8 * nb],
        [kvIdx, 4 * nb * nb],
        [fullIdx, 4 * nb * nb],
      ],
      owned: [se, ends, nums, kvIdx, fullIdx, P],
    };
  });
  const counts = new Int32Array(numBytes);
  return {
    block_size: B,
    num_blocks: nb,
    block_kv_num_blocks: counts.slice(0, nb),
    block_kv_indices: new Int32Array(kvBytes),
    block_full_kv_num_blocks: counts.slice(nb),
    block_full_kv_indices: new Int32Array(fullBytes),
  };
}
