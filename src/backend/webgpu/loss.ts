/**
 * The loss on WebGPU, per occurrence and in the compact per-node mode. Once per (batch or plan, config, chunk size)
 * the host lays the data out in chunks that each fit one storage binding (loss-layout.ts), uploads them and builds
 * every buffer and bind group a call needs; each call then only uploads lp, submits one command buffer and maps one
 * staging buffer per chunk (gradient slice and metric partials). Partials are summed here in float64 in a fixed
 * order, and a node cut between chunks sums its partial gradients in chunk order: results are identical run to run.
 *
 * `chunkBytes` (or `TREEPACK_WEBGPU_LOSS_CHUNK_BYTES`) lowers the bytes per binding below the device's limit (tests
 * use it to cross chunk boundaries on small inputs); it is part of the layout's key. Calls on the same layout are
 * serialised (they share its buffers); calls on different layouts share nothing but the compiled pipelines, so
 * overlapping calls give the same bits as calls one at a time. A layout replaced in the cache is destroyed only
 * once the last call holding it has finished.
 */
import { TreepackError } from '../../errors.js';
import { configCodes, type LossConfig } from '../../loss/config.js';
import type { CompactPlan, LossBatch, LossMetrics, LossResult } from '../../loss/types.js';
import { webgpuContext } from './device.js';
import {
  chunkIndex,
  compactArrays,
  COMPACT_NODE_BYTES,
  compactPerThread,
  fillOccArrays,
  OCC_BYTES,
  occPerThread,
  occStream,
  planOccChunks,
  SEQ_OCC_BYTES,
  seqChunks,
} from './loss-layout.js';
import { LOSS_WGSL, NSUMS, WG } from './loss.wgsl.js';

export const CHUNK_BYTES_ENV = 'TREEPACK_WEBGPU_LOSS_CHUNK_BYTES';

type Entry = 'gspo_seq' | 'occ_nodes' | 'compact';

interface Dispatch {
  entry: Entry;
  bind: GPUBindGroup;
  groups: [number, number];
}

/** One chunk's outputs: the gradient of nodes [n0, n0 + nodes) and its metric partials. */
interface Output {
  n0: number;
  nodes: number;
  /** Its first node continues from the previous chunk / its last node goes on in the next. */
  splitFirst: boolean;
  splitLast: boolean;
  lp: GPUBuffer;
  grad: GPUBuffer;
  partials: GPUBuffer;
  groups: number;
  staging: GPUBuffer;
}

interface Job {
  device: GPUDevice;
  dispatches: Dispatch[];
  outputs: Output[];
  /** GSPO reads lp by node across all chunks: the whole of it, unless the one chunk already holds it. */
  lpWhole?: GPUBuffer;
  buffers: GPUBuffer[];
  tail: Promise<unknown>;
}

/** The cached layout of a batch or plan object: one per owner, replaced when the key (config, chunk size) changes. */
interface Cached {
  key: string;
  device: GPUDevice;
  job: Promise<Job>;
  /** Calls holding the job; a replaced (retired) job is destroyed when this drops to 0. */
  users: number;
  retired: boolean;
}

const jobs = new WeakMap<object, Cached>();
const pipelines = new WeakMap<GPUDevice, Record<Entry, GPUComputePipeline>>();

function pipelinesFor(device: GPUDevice): Record<Entry, GPUComputePipeline> {
  let p = pipelines.get(device);
  if (!p) {
    const module = device.createShaderModule({ code: LOSS_WGSL });
    const make = (entryPoint: Entry) => device.createComputePipeline({ layout: 'auto', compute: { module, entryPoint } });
    p = { gspo_seq: make('gspo_seq'), occ_nodes: make('occ_nodes'), compact: make('compact') };
    pipelines.set(device, p);
  }
  return p;
}

export interface WebGPULossOptions {
  /** Bytes per storage binding, at least 64, capped at the device's limit; default `TREEPACK_WEBGPU_LOSS_CHUNK_BYTES`, else the limit. */
  chunkBytes?: number;
}

/** The bytes one binding may hold: the device's limit, or the requested size when lower. */
export function chunkBytes(device: GPUDevice, requested?: number): number {
  const limit = Math.min(device.limits.maxStorageBufferBindingSize, device.limits.maxBufferSize);
  const raw = process.env[CHUNK_BYTES_ENV];
  if (requested === undefined && (raw === undefined || raw === '')) return limit;
  const v = requested ?? Number(raw);
  const field = requested === undefined ? CHUNK_BYTES_ENV : 'chunkBytes';
  if (!Number.isInteger(v) || v < 64)
    throw new TreepackError('E_ARG', `Expected an integer ≥ 64 for ${field} but received ${JSON.stringify(requested ?? raw)}`, { field });
  return Math.min(v, limit);
}

/** Workgroup grid for n groups: at most 65535 per dimension (the kernels flatten it and skip the overshoot). */
function grid(device: GPUDevice, groups: number): [number, number] {
  const x = Math.max(1, Math.min(groups, device.limits.maxComputeWorkgroupsPerDimension));
  return [x, Math.max(1, Math.ceil(groups / x))];
}

/** Builds a job's buffers; every one it creates is recorded for destruction. */
class Builder {
  readonly buffers: GPUBuffer[] = [];
  readonly dispatches: Dispatch[] = [];
  readonly outputs: Output[] = [];
  private readonly pipes: Record<Entry, GPUComputePipeline>;
  /**
   * Stand-ins for bindings an entry point declares but this config never touches: one read-only, one writable (one
   * buffer cannot be both in a dispatch).
   */
  readonly dummy: GPUBuffer;
  readonly dummyWritable: GPUBuffer;

  constructor(
    readonly device: GPUDevice,
    private readonly cfg: LossConfig,
  ) {
    this.pipes = pipelinesFor(device);
    this.dummy = this.buffer(16, GPUBufferUsage.STORAGE);
    this.dummyWritable = this.buffer(16, GPUBufferUsage.STORAGE);
  }

  buffer(bytes: number, usage: number, data?: ArrayBufferView, mappedAtCreation = false): GPUBuffer {
    const size = Math.max(16, Math.ceil(bytes / 4) * 4);
    const buf = this.device.createBuffer({ size, usage: usage | GPUBufferUsage.COPY_DST, mappedAtCreation });
    this.buffers.push(buf);
    if (data && data.byteLength) this.device.queue.writeBuffer(buf, 0, data.buffer, data.byteOffset, data.byteLength);
    return buf;
  }

  storage(data: ArrayBufferView): GPUBuffer {
    return this.buffer(data.byteLength, GPUBufferUsage.STORAGE, data);
  }

  /** A storage buffer mapped for the host to write its contents in place (no staging copy); unmap before use. */
  mapped(bytes: number): GPUBuffer {
    return this.buffer(bytes, GPUBufferUsage.STORAGE, undefined, true);
  }

  /** The uniform Params of loss.wgsl.ts: the config, then one dispatch's counts. */
  params(count: number, base = 0, firstTotal = 0, lastOpen = 0, perThread = 0): GPUBuffer {
    const c = configCodes(this.cfg);
    const data = new ArrayBuffer(48);
    new Float32Array(data, 0, 5).set([
      this.cfg.clip_low,
      this.cfg.clip_high,
      this.cfg.dual_clip,
      this.cfg.log_ratio_clamp,
      this.cfg.kl_coef,
    ]);
    new Uint32Array(data, 20, 7).set([c.policy, c.kl, count, base, firstTotal, lastOpen, perThread]);
    return this.buffer(48, GPUBufferUsage.UNIFORM, new Uint8Array(data));
  }

  dispatch(entry: Entry, groups: number, bindings: Record<number, GPUBuffer>): void {
    const layout = this.pipes[entry].getBindGroupLayout(0);
    const entries = Object.entries(bindings).map(([binding, buffer]) => ({ binding: Number(binding), resource: { buffer } }));
    this.dispatches.push({ entry, bind: this.device.createBindGroup({ layout, entries }), groups: grid(this.device, groups) });
  }

  /** The per-chunk buffers every entry point writes: lp slice in, gradient slice and partials out, and their staging. */
  output(n0: number, nodes: number, groups: number, splitFirst = false, splitLast = false): Output {
    const [x, y] = grid(this.device, groups);
    const out: Output = {
      n0,
      nodes,
      splitFirst,
      splitLast,
      groups: x * y,
      lp: this.buffer(4 * nodes, GPUBufferUsage.STORAGE),
      grad: this.buffer(4 * nodes, GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC),
      partials: this.buffer(4 * NSUMS * x * y, GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC),
      staging: this.buffer(4 * nodes + 4 * NSUMS * x * y, GPUBufferUsage.MAP_READ),
    };
    this.outputs.push(out);
    return out;
  }
}

async function errorsOf<T>(device: GPUDevice, what: string, build: () => T, destroy: (t: T | undefined) => void): Promise<T> {
  device.pushErrorScope('validation');
  device.pushErrorScope('out-of-memory');
  let built: T | undefined;
  let thrown: Error | undefined;
  try {
    built = build();
  } catch (err) {
    thrown = err instanceof Error ? err : new Error(String(err));
  }
  // Both scopes are popped before any await: another call's scopes pushed meanwhile must not be popped as ours.
  const [oom, invalid] = await Promise.all([device.popErrorScope(), device.popErrorScope()]);
  if (thrown || oom || invalid) {
    destroy(built);
    if (thrown) throw thrown;
    if (oom) throw new TreepackError('E_LIMIT', `webgpu loss: out of device memory while preparing ${what}: ${oom.message}`);
    throw new TreepackError('E_BACKEND', `webgpu loss: ${invalid!.message}`);
  }
  return built!;
}

function destroyJob(job: Pick<Job, 'buffers'> | undefined): void {
  for (const b of job?.buffers ?? []) b.destroy();
}

async function device(): Promise<GPUDevice> {
  const acquired = await webgpuContext();
  if (!acquired.ok) throw new TreepackError('E_BACKEND', `webgpu unavailable: ${acquired.reason}`);
  return acquired.ctx.device;
}

/**
 * Runs `lp` through the cached job of `owner` for this key, or a new one built by `build`. The cache is read and
 * replaced synchronously, so concurrent first calls share one build, and a replaced job is kept until its last
 * call has finished.
 */
async function runCached(
  owner: object,
  dev: GPUDevice,
  key: string,
  what: string,
  build: () => Omit<Job, 'tail'>,
  lp: Float32Array,
  cfg: LossConfig,
): Promise<LossResult> {
  let entry = jobs.get(owner);
  if (entry === undefined || entry.key !== key || entry.device !== dev) {
    if (entry) retire(entry);
    const job: Promise<Job> = errorsOf(dev, what, build, destroyJob).then(
      (built) => ({ ...built, tail: Promise.resolve() }),
      (err: unknown) => {
        if (jobs.get(owner)?.job === job) jobs.delete(owner); // a failed build is not cached
        throw err;
      },
    );
    jobs.set(owner, (entry = { key, device: dev, job, users: 0, retired: false }));
  }
  const held = entry;
  held.users++;
  try {
    const job = await held.job;
    return await serial(job, () => execute(job, lp, cfg));
  } finally {
    held.users--;
    if (held.retired && held.users === 0) destroyCached(held);
  }
}

function retire(entry: Cached): void {
  entry.retired = true;
  if (entry.users === 0) destroyCached(entry);
}

function destroyCached(entry: Cached): void {
  entry.job.then(destroyJob, () => undefined);
}

function prepareOccurrences(dev: GPUDevice, b: LossBatch, cfg: LossConfig, limit: number): Omit<Job, 'tail'> {
  const N = b.input_ids.length;
  const gspo = cfg.policy === 'gspo';
  const stream = occStream(b, cfg);
  const G = stream.seqIndex.length;
  const deviceLimit = Math.min(dev.limits.maxStorageBufferBindingSize, dev.limits.maxBufferSize);
  if (gspo && 4 * N > deviceLimit)
    throw new TreepackError(
      'E_LIMIT',
      `webgpu loss: gspo reads logprobs of any node in one binding: N = ${N} nodes need ${4 * N} bytes, over this adapter's limit of ${deviceLimit}`,
    );
  if (gspo && 4 * G > deviceLimit)
    throw new TreepackError(
      'E_LIMIT',
      `webgpu loss: gspo keeps one ratio per sequence in one binding: ${G} sequences need ${4 * G} bytes, over this adapter's limit of ${deviceLimit}`,
    );
  const B = new Builder(dev, cfg);
  const withB = cfg.kl !== 'none' || gspo;
  const seqLr = gspo ? B.buffer(4 * G, GPUBufferUsage.STORAGE) : B.dummyWritable;
  // idx holds L+1 node offsets and at most L+1 thread starts: 8 bytes per node.
  const chunks = planOccChunks(stream.nodeOff, Math.floor(limit / OCC_BYTES), Math.floor(limit / 8) - 1);
  const perThread = occPerThread(stream.nodeOff[N]);
  const outputs = chunks.map((c) => {
    const { index, threads } = chunkIndex(stream.nodeOff, c, perThread);
    const n = c.o1 - c.o0;
    return { c, index, threads, occA: B.mapped(OCC_BYTES * n), occB: withB ? B.mapped(8 * n) : B.dummy, L: c.n1 - c.n0 + 1 };
  });
  fillOccArrays(
    b,
    cfg,
    stream,
    chunks,
    outputs.map((o) => ({
      a: new Float32Array(o.occA.getMappedRange()),
      b: withB ? new Float32Array(o.occB.getMappedRange()) : undefined,
    })),
  );
  for (const o of outputs) {
    o.occA.unmap();
    if (withB) o.occB.unmap();
  }
  let lpWhole: GPUBuffer | undefined;
  if (gspo) {
    const one = chunks.length === 1 && chunks[0].n0 === 0 && chunks[0].n1 === N - 1;
    lpWhole = one || chunks.length === 0 ? undefined : B.buffer(4 * N, GPUBufferUsage.STORAGE);
    const outs: Output[] = [];
    for (const o of outputs)
      outs.push(B.output(o.c.n0, o.L, Math.ceil(o.threads / WG), o.c.o0 > stream.nodeOff[o.c.n0], o.c.o1 < stream.nodeOff[o.c.n1 + 1]));
    const lpAll = lpWhole ?? outs[0]?.lp ?? B.dummy;
    for (const s of seqChunks(b, stream, Math.floor(limit / SEQ_OCC_BYTES))) {
      const nseq = s.range.length - 1;
      B.dispatch('gspo_seq', nseq, {
        0: B.params(nseq, s.r0, s.firstTotal, s.lastOpen ? 1 : 0),
        3: lpAll,
        7: seqLr,
        8: B.storage(s.pairs),
        9: B.storage(s.range),
      });
    }
    outputs.forEach((o, i) => occDispatch(B, o, outs[i], seqLr));
  } else {
    for (const o of outputs)
      occDispatch(
        B,
        o,
        B.output(o.c.n0, o.L, Math.ceil(o.threads / WG), o.c.o0 > stream.nodeOff[o.c.n0], o.c.o1 < stream.nodeOff[o.c.n1 + 1]),
        seqLr,
      );
  }
  return { device: dev, dispatches: B.dispatches, outputs: B.outputs, lpWhole, buffers: B.buffers };
}

function occDispatch(
  B: Builder,
  o: { index: Uint32Array; threads: number; occA: GPUBuffer; occB: GPUBuffer; L: number },
  out: Output,
  seqLr: GPUBuffer,
): void {
  B.dispatch('occ_nodes', Math.ceil(o.threads / WG), {
    0: B.params(o.threads, o.L + 1),
    1: o.occA,
    2: o.occB,
    3: out.lp,
    4: B.storage(o.index),
    5: out.grad,
    6: out.partials,
    7: seqLr,
  });
}

function prepareCompact(dev: GPUDevice, plan: CompactPlan, cfg: LossConfig, limit: number): Omit<Job, 'tail'> {
  const B = new Builder(dev, cfg);
  const maxNodes = Math.floor(limit / COMPACT_NODE_BYTES);
  const per = compactPerThread(plan.num_nodes);
  for (let n0 = 0; n0 < plan.num_nodes; n0 += maxNodes) {
    const L = Math.min(maxNodes, plan.num_nodes - n0);
    const { a, b } = compactArrays(plan, n0, L);
    const groups = Math.ceil(L / (WG * per));
    const out = B.output(n0, L, groups);
    B.dispatch('compact', groups, {
      0: B.params(L, 0, 0, 0, per),
      3: out.lp,
      5: out.grad,
      6: out.partials,
      10: B.storage(a),
      11: B.storage(b),
    });
  }
  return { device: dev, dispatches: B.dispatches, outputs: B.outputs, buffers: B.buffers };
}

/** Runs calls on one job one at a time: they share its buffers. */
function serial<T>(job: Job, fn: () => Promise<T>): Promise<T> {
  const run = job.tail.then(fn);
  job.tail = run.catch(() => undefined);
  return run;
}

async function execute(job: Job, lp: Float32Array, cfg: LossConfig): Promise<LossResult> {
  const dev = job.device;
  const write = (buf: GPUBuffer, n0: number, n: number) => dev.queue.writeBuffer(buf, 0, lp.buffer, lp.byteOffset + 4 * n0, 4 * n);
  for (const o of job.outputs) write(o.lp, o.n0, o.nodes);
  if (job.lpWhole && lp.length) write(job.lpWhole, 0, lp.length);
  const pipes = pipelinesFor(dev);
  dev.pushErrorScope('validation');
  const enc = dev.createCommandEncoder();
  if (job.dispatches.length) {
    const pass = enc.beginComputePass();
    for (const d of job.dispatches) {
      pass.setPipeline(pipes[d.entry]);
      pass.setBindGroup(0, d.bind);
      pass.dispatchWorkgroups(d.groups[0], d.groups[1]);
    }
    pass.end();
  }
  for (const o of job.outputs) {
    enc.copyBufferToBuffer(o.grad, 0, o.staging, 0, 4 * o.nodes);
    enc.copyBufferToBuffer(o.partials, 0, o.staging, 4 * o.nodes, 4 * NSUMS * o.groups);
  }
  dev.queue.submit([enc.finish()]);
  const invalid = dev.popErrorScope();
  const mapped = await Promise.allSettled(job.outputs.map((o) => o.staging.mapAsync(GPUMapMode.READ)));
  const err = await invalid;
  if (err) throw new TreepackError('E_BACKEND', `webgpu loss: ${err.message}`);
  for (const m of mapped)
    if (m.status === 'rejected') throw new TreepackError('E_BACKEND', `webgpu loss: reading the results failed: ${String(m.reason)}`);
  const grad = new Float32Array(lp.length);
  const s = new Float64Array(NSUMS);
  s[8] = Infinity;
  s[9] = -Infinity;
  let open = 0; // the partial sum of a node cut between chunks, carried in float64
  try {
    for (const o of job.outputs) {
      const range = o.staging.getMappedRange();
      const g = new Float32Array(range, 0, o.nodes);
      grad.set(g, o.n0);
      if (o.splitFirst) grad[o.n0] = open + g[0];
      if (o.splitLast) open = o.nodes === 1 && o.splitFirst ? open + g[0] : g[o.nodes - 1];
      else open = 0;
      const pf = new Float32Array(range, 4 * o.nodes, NSUMS * o.groups);
      const pu = new Uint32Array(range, 4 * o.nodes, NSUMS * o.groups);
      for (let k = 0; k < o.groups; k++) {
        const at = k * NSUMS;
        s[0] += pf[at];
        s[1] += pf[at + 1];
        for (let f = 2; f < 6; f++) s[f] += pu[at + f];
        s[6] += pf[at + 6];
        s[7] += pf[at + 7];
        s[8] = Math.min(s[8], pf[at + 8]);
        s[9] = Math.max(s[9], pf[at + 9]);
      }
    }
  } finally {
    for (const o of job.outputs) o.staging.unmap();
  }
  return { loss: s[0] + cfg.kl_coef * s[1], grad, metrics: metrics(s, cfg) };
}

function metrics(s: Float64Array, cfg: LossConfig): LossMetrics {
  const n = s[2];
  const per = (x: number) => (n ? x / n : 0);
  const loss = s[0] + cfg.kl_coef * s[1];
  return {
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
  };
}

/**
 * Per-occurrence loss. The prepared layout is cached per batch object and config: do not mutate a batch's arrays in
 * place between calls.
 */
export async function lossWebGPU(b: LossBatch, lp: Float32Array, cfg: LossConfig, opts: WebGPULossOptions = {}): Promise<LossResult> {
  const dev = await device();
  const limit = chunkBytes(dev, opts.chunkBytes);
  // seq_weight is the trainer's per call, not the batch's: its values are part of the key.
  const key = `${limit} ${JSON.stringify(cfg)} ${b.seq_weight ? b.seq_weight.join(',') : ''}`;
  return runCached(b, dev, key, 'the loss batch', () => prepareOccurrences(dev, b, cfg, limit), lp, cfg);
}

/** Compact per-node loss; the uploaded plan is cached per plan object and config. */
export async function lossCompactWebGPU(
  plan: CompactPlan,
  lp: Float32Array,
  cfg: LossConfig,
  opts: WebGPULossOptions = {},
): Promise<LossResult> {
  const dev = await device();
  const limit = chunkBytes(dev, opts.chunkBytes);
  return runCached(plan, dev, `${limit} ${JSON.stringify(cfg)}`, 'the compact plan', () => prepareCompact(dev, plan, cfg, limit), lp, cfg);
}
