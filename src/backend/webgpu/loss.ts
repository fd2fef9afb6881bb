/**
 * The loss on WebGPU. The host prepares, once per (batch, config), the list of trainable occurrences with their
 * weights and the node → occurrences index (a stable counting sort, so the gradient sums in a fixed order); each
 * call uploads lp, runs loss_wgsl.ts's three kernels, and reads back the gradient and per-workgroup metric
 * partials, which are summed here in float64.
 */
import { TreepackError } from '../../errors.js';
import { countTrainable, sequenceWeight } from '../../loss/aggregate.js';
import { configCodes, type LossConfig } from '../../loss/config.js';
import { truncatedWeight } from '../../loss/policy.js';
import type { LossBatch, LossResult } from '../../loss/types.js';
import { webgpuContext } from './device.js';
import { LOSS_WGSL } from './loss_wgsl.js';

const WG = 128; // as in loss_wgsl.ts
const NSUMS = 10;

interface Prepared {
  key: string;
  count: number; // trainable occurrences T
  occ: GPUBuffer; // 8 f32 per occurrence
  seqRange: GPUBuffer; // [S+1] u32
  nodeOff: GPUBuffer; // [N+1] u32
  nodeOcc: GPUBuffer; // [T] u32
}

const prepared = new WeakMap<LossBatch, Prepared>();
const pipelines = new WeakMap<GPUDevice, Record<'gspo_seq' | 'occurrences' | 'nodes', GPUComputePipeline>>();

function upload(device: GPUDevice, data: ArrayBufferView, usage = GPUBufferUsage.STORAGE): GPUBuffer {
  const size = Math.max(16, Math.ceil(data.byteLength / 4) * 4);
  const buf = device.createBuffer({ size, usage: usage | GPUBufferUsage.COPY_DST });
  if (data.byteLength) device.queue.writeBuffer(buf, 0, data.buffer, data.byteOffset, data.byteLength);
  return buf;
}

function prepare(device: GPUDevice, b: LossBatch, cfg: LossConfig): Prepared {
  const key = JSON.stringify(cfg);
  const cached = prepared.get(b);
  if (cached?.key === key) return cached;
  if (cached) for (const buf of [cached.occ, cached.seqRange, cached.nodeOff, cached.nodeOcc]) buf.destroy();
  const { seq_offsets: off, seq_positions: pos, loss_mask: mask } = b;
  const S = off.length - 1;
  const N = b.input_ids.length;
  const counts = new Int32Array(S);
  const norm = countTrainable(off, mask, cfg, counts);
  let T = 0;
  for (let i = 0; i < S; i++) T += counts[i];
  const limit = device.limits.maxStorageBufferBindingSize;
  if (T * 32 > limit) {
    throw new TreepackError('E_LIMIT', `webgpu loss: ${T} trainable occurrences need ${T * 32} bytes, over this adapter's storage binding limit of ${limit}`);
  }
  const occ = new Float32Array(8 * T);
  const occU = new Uint32Array(occ.buffer);
  const seqRange = new Uint32Array(S + 1);
  const perNode = new Uint32Array(N + 1);
  let k = 0;
  for (let i = 0; i < S; i++) {
    seqRange[i] = k;
    if (counts[i] === 0) continue;
    const w = sequenceWeight(cfg, counts[i], norm);
    let seqTis = 1;
    if (cfg.tis === 'sequence') {
      let s = 0;
      for (let j = off[i]; j < off[i + 1]; j++) if (mask[j]) s += b.old_logprobs![j] - b.rollout_logprobs![j];
      seqTis = truncatedWeight(s, cfg.log_ratio_clamp, cfg.tis_cap);
    }
    for (let j = off[i]; j < off[i + 1]; j++) {
      if (!mask[j]) continue;
      const old = b.old_logprobs![j];
      const tis = cfg.tis === 'token' ? truncatedWeight(old - b.rollout_logprobs![j], cfg.log_ratio_clamp, cfg.tis_cap) : seqTis;
      const o = 8 * k;
      occ[o] = w * tis;
      occ[o + 1] = w;
      occ[o + 2] = b.advantages![j];
      occ[o + 3] = old;
      occ[o + 4] = cfg.kl !== 'none' ? b.ref_logprobs![j] : 0;
      occU[o + 5] = pos[j];
      occU[o + 6] = i;
      perNode[pos[j] + 1]++;
      k++;
    }
  }
  seqRange[S] = k;
  for (let p = 0; p < N; p++) perNode[p + 1] += perNode[p];
  const nodeOcc = new Uint32Array(T);
  const fill = perNode.slice(0, N);
  for (let t = 0; t < T; t++) nodeOcc[fill[occU[8 * t + 5]]++] = t;
  const p: Prepared = {
    key,
    count: T,
    occ: upload(device, occ),
    seqRange: upload(device, seqRange),
    nodeOff: upload(device, perNode),
    nodeOcc: upload(device, nodeOcc),
  };
  prepared.set(b, p);
  return p;
}

function pipelinesFor(device: GPUDevice) {
  let p = pipelines.get(device);
  if (!p) {
    const module = device.createShaderModule({ code: LOSS_WGSL });
    const make = (entryPoint: string) => device.createComputePipeline({ layout: 'auto', compute: { module, entryPoint } });
    p = { gspo_seq: make('gspo_seq'), occurrences: make('occurrences'), nodes: make('nodes') };
    pipelines.set(device, p);
  }
  return p;
}

/** Workgroup grid for n threads: at most 65535 per dimension. */
function grid(n: number): [number, number] {
  const groups = Math.max(1, Math.ceil(n / WG));
  const x = Math.min(groups, 65535);
  return [x, Math.ceil(groups / x)];
}

export async function lossWebGPU(b: LossBatch, lp: Float32Array, cfg: LossConfig): Promise<LossResult> {
  const acquired = await webgpuContext();
  if (!acquired.ok) throw new TreepackError('E_BACKEND', `webgpu unavailable: ${acquired.reason}`);
  const device = acquired.ctx.device;
  const prep = prepare(device, b, cfg);
  const S = b.seq_offsets.length - 1;
  const N = lp.length;
  const codes = configCodes(cfg);
  const params = new ArrayBuffer(48);
  new Float32Array(params, 0, 5).set([cfg.clip_low, cfg.clip_high, cfg.dual_clip, cfg.log_ratio_clamp, cfg.kl_coef]);
  new Uint32Array(params, 20, 5).set([codes.policy, codes.kl, prep.count, S, N]);
  const uniform = upload(device, new Uint8Array(params), GPUBufferUsage.UNIFORM);
  const lpBuf = upload(device, lp);
  const seqLr = device.createBuffer({ size: Math.max(16, 4 * S), usage: GPUBufferUsage.STORAGE });
  const contrib = device.createBuffer({ size: Math.max(16, 4 * prep.count), usage: GPUBufferUsage.STORAGE });
  const [ox, oy] = grid(prep.count);
  const partialBytes = 4 * NSUMS * ox * oy;
  const partials = device.createBuffer({ size: partialBytes, usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC });
  const gradBuf = device.createBuffer({ size: Math.max(16, 4 * N), usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC });
  const readGrad = device.createBuffer({ size: Math.max(16, 4 * N), usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
  const readPartials = device.createBuffer({ size: partialBytes, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
  const buffers: Record<number, GPUBuffer> = { 0: uniform, 1: prep.occ, 2: lpBuf, 3: seqLr, 4: prep.seqRange, 5: contrib, 6: partials, 7: prep.nodeOff, 8: prep.nodeOcc, 9: gradBuf };
  const used: Record<string, number[]> = { gspo_seq: [0, 1, 2, 3, 4], occurrences: [0, 1, 2, 3, 5, 6], nodes: [0, 5, 7, 8, 9] };
  device.pushErrorScope('validation');
  const pipes = pipelinesFor(device);
  const enc = device.createCommandEncoder();
  const pass = enc.beginComputePass();
  const run = (name: 'gspo_seq' | 'occurrences' | 'nodes', n: number) => {
    const bindings = used[name]; // auto layouts hold exactly the bindings an entry point references
    const pipeline = pipes[name];
    pass.setPipeline(pipeline);
    pass.setBindGroup(0, device.createBindGroup({ layout: pipeline.getBindGroupLayout(0), entries: bindings.map((i) => ({ binding: i, resource: { buffer: buffers[i] } })) }));
    const [x, y] = grid(name === 'gspo_seq' ? n * WG : n);
    pass.dispatchWorkgroups(x, y);
  };
  if (codes.policy === 1) run('gspo_seq', S);
  run('occurrences', prep.count);
  run('nodes', N);
  pass.end();
  enc.copyBufferToBuffer(gradBuf, 0, readGrad, 0, Math.max(16, 4 * N));
  enc.copyBufferToBuffer(partials, 0, readPartials, 0, partialBytes);
  device.queue.submit([enc.finish()]);
  const invalid = await device.popErrorScope();
  if (invalid) {
    for (const buf of [uniform, lpBuf, seqLr, contrib, partials, gradBuf, readGrad, readPartials]) buf.destroy();
    throw new TreepackError('E_BACKEND', `webgpu loss: ${invalid.message}`);
  }
  await Promise.all([readGrad.mapAsync(GPUMapMode.READ), readPartials.mapAsync(GPUMapMode.READ)]);
  const grad = new Float32Array(readGrad.getMappedRange().slice(0, 4 * N));
  const part = new Float32Array(readPartials.getMappedRange().slice(0));
  for (const buf of [uniform, lpBuf, seqLr, contrib, partials, gradBuf, readGrad, readPartials]) buf.destroy();

  const s = new Float64Array(NSUMS);
  s[8] = Infinity;
  s[9] = -Infinity;
  for (let g = 0; g < ox * oy; g++) {
    for (let f = 0; f < 8; f++) s[f] += part[g * NSUMS + f];
    s[8] = Math.min(s[8], part[g * NSUMS + 8]);
    s[9] = Math.max(s[9], part[g * NSUMS + 9]);
  }
  const n = s[2];
  const per = (x: number) => (n ? x / n : 0);
  const loss = s[0] + cfg.kl_coef * s[1];
  return {
    loss,
    grad,
    metrics: {
      loss,
      pg_loss: s[0],
      kl_loss: s[1],
      clipfrac_high: per(s[3]),
      clipfrac_low: per(s[4]),
      clipfrac_dual: per(s[5]),
      approx_kl: per(s[6]),
      ratio_mean: per(s[7]),
      ratio_min: n ? s[8] : 0,
      ratio_max: n ? s[9] : 0,
      trainable_tokens: n,
    },
  };
}
