/**
 * One registry for every backend (onnxruntime-node / tfjs style): backends register with a priority and their life
 * cycle (init, dispose, limits); kernels register per (backend, op). Resolution walks backends by priority,
 * initialising each at most once (a failure is remembered with its reason and never retried), and returns the first
 * that has the op, together with a report of what was tried and why, so callers can say what ran. Only this module
 * starts and tears down a backend: `disposeBackends()` is the one call that releases devices.
 */
import { TreepackError } from '../errors.js';
import type { LossConfig } from '../loss/config.js';
import type { CompactPlan, LossBatch, LossResult } from '../loss/types.js';
import type { BlockMask, TreeArrays } from '../mask/types.js';
import { hostLimits, type OutputLimits } from '../mask/validate.js';
import type { Forest, Sequences } from '../pack/contract.js';

/** A backend: `cuda`, `webgpu`, `cpu` (the C++ core) or `js` (the reference). */
export type BackendName = 'cuda' | 'webgpu' | 'cpu' | 'js';
/** Every backend in the order `auto` tries them. */
export const BACKEND_NAMES: readonly BackendName[] = ['cuda', 'webgpu', 'cpu', 'js'];

/**
 * Every op a backend may implement. Kernels receive input already checked by the dispatch layer (ops.ts): they
 * neither validate nor check output sizes.
 */
export interface Kernels {
  packForest: (seqs: Sequences) => Forest;
  /** Mask lowerings (src/mask): async because GPU backends read their results back. */
  maskDense: (tree: TreeArrays) => Promise<Uint8Array>;
  maskBits: (tree: TreeArrays) => Promise<Uint32Array>;
  maskBlocks: (tree: TreeArrays, blockSize: number) => Promise<BlockMask>;
  maskSlices: (tree: TreeArrays) => Promise<Int32Array>;
  maskCuSeqlens: (tree: TreeArrays) => Promise<Int32Array>;
  /** Per-occurrence RL loss, gradient and metrics. */
  loss: (batch: LossBatch, lp: Float32Array, cfg: LossConfig) => Promise<LossResult>;
  /** The same from a compact per-node plan (buildCompactPlan). */
  lossCompact: (plan: CompactPlan, lp: Float32Array, cfg: LossConfig) => Promise<LossResult>;
}
/** An op of the backend registry (packForest, the mask lowerings, loss, lossCompact). */
export type OpName = keyof Kernels;

/** What a backend can allocate, and for WebGPU the device limits behind it. */
export interface BackendLimits extends OutputLimits {
  device?: Record<string, number>;
}

export interface BackendEntry {
  name: BackendName;
  priority: number;
  /** Starts the backend; returns what it runs on, throws when it cannot run here. */
  init: () => Promise<string> | string;
  /** Releases what init acquired (devices), so the process can exit; the next use initialises again. */
  dispose?: () => Promise<void> | void;
  /** Output limits once initialised; host limits (2 GiB per lowering) when absent. */
  limits?: () => BackendLimits;
  /**
   * Once initialised: whether it runs in software emulation (WebGPU's fallback adapter, the CUDA emulator). `auto` then ranks it below
   * the C++ core, which runs the same kernels natively; named explicitly, it runs as asked.
   */
  software?: () => boolean;
}

/** What listBackends and `treepack doctor` say of a backend: available or not and why, its ops and limits. */
export interface BackendStatus {
  name: BackendName;
  priority: number;
  available: boolean;
  /** Why it is unavailable, or what it runs on when available. */
  detail: string;
  ops: OpName[];
  limits?: BackendLimits;
}

interface Registered {
  entry: BackendEntry;
  state?: { ok: true; detail: string } | { ok: false; detail: string };
  pending?: Promise<void>;
}

const backends = new Map<BackendName, Registered>();
const kernels = new Map<string, unknown>();

export function registerBackend(entry: BackendEntry): void {
  if (backends.has(entry.name)) throw new TreepackError('E_BACKEND', `backend '${entry.name}' is already registered`);
  backends.set(entry.name, { entry });
}

export function registerKernel<K extends OpName>(backend: BackendName, op: K, impl: Kernels[K]): void {
  const key = `${backend}_${op}`;
  if (kernels.has(key)) throw new TreepackError('E_BACKEND', `kernel '${op}' is already registered for backend '${backend}'`);
  kernels.set(key, impl);
}

function opsOf(name: BackendName): OpName[] {
  const ops: OpName[] = [];
  for (const key of kernels.keys()) if (key.startsWith(name + '_')) ops.push(key.slice(name.length + 1) as OpName);
  return ops;
}

async function ensureInit(r: Registered): Promise<void> {
  if (r.state) return;
  r.pending ??= (async () => {
    try {
      r.state = { ok: true, detail: await r.entry.init() };
    } catch (err) {
      r.state = { ok: false, detail: err instanceof Error ? err.message : String(err) };
    }
  })();
  await r.pending;
}

function limitsOf(r: Registered): BackendLimits {
  return r.entry.limits?.() ?? hostLimits(r.entry.name);
}

function sorted(): Registered[] {
  return [...backends.values()].sort((a, b) => b.entry.priority - a.entry.priority);
}

/** Status of every registered backend, initialising each (once). */
export async function listBackends(): Promise<BackendStatus[]> {
  const out: BackendStatus[] = [];
  for (const r of sorted()) {
    await ensureInit(r);
    const { name, priority } = r.entry;
    const status: BackendStatus = { name, priority, available: r.state!.ok, detail: r.state!.detail, ops: opsOf(name) };
    if (r.state!.ok) status.limits = limitsOf(r);
    out.push(status);
  }
  return out;
}

export interface Found<K extends OpName> {
  backend: BackendName;
  kernel: Kernels[K];
  limits: BackendLimits;
  /** The chosen backend and, before it, every higher-priority backend skipped and why. */
  report: string;
}

/**
 * The raw kernel for `op` (unchecked input: ops.ts wraps it): on `preferred` when given (an error if it is
 * unavailable or lacks the op: an explicit choice is never silently replaced), else on the highest-priority
 * available backend that implements it.
 */
export async function findKernel<K extends OpName>(op: K, preferred?: BackendName | 'auto'): Promise<Found<K>> {
  const skipped: string[] = [];
  for (const r of sorted()) {
    const { name } = r.entry;
    if (preferred && preferred !== 'auto' && name !== preferred) continue;
    const kernel = kernels.get(`${name}_${op}`) as Kernels[K] | undefined;
    if (!kernel) {
      skipped.push(`${name}: no '${op}' kernel`);
      continue;
    }
    await ensureInit(r);
    if (!r.state!.ok) {
      skipped.push(`${name}: ${r.state!.detail}`);
      continue;
    }
    if (preferred !== name && r.entry.software?.() && (await nativeHas(op))) {
      skipped.push(`${name}: ${r.state!.detail}, emulated in software, slower than the C++ core`);
      continue;
    }
    const why = skipped.length ? ` (skipped ${skipped.join('; ')})` : '';
    return { backend: name, kernel, limits: limitsOf(r), report: `${op} on ${name}: ${r.state!.detail}${why}` };
  }
  if (preferred && preferred !== 'auto' && !backends.has(preferred)) {
    throw new TreepackError('E_ARG', `Expected one of ${[...backends.keys()].join(', ')} for backend but received '${preferred}'`);
  }
  throw new TreepackError('E_BACKEND', `no available backend for '${op}': ${skipped.join('; ')}`);
}

/** Whether the C++ core (cpu) runs `op` here: what `auto` takes instead of a software-emulated backend. */
async function nativeHas(op: OpName): Promise<boolean> {
  const cpu = backends.get('cpu');
  if (!cpu || !kernels.has(`cpu_${op}`)) return false;
  await ensureInit(cpu);
  return cpu.state!.ok;
}

/** Disposes `name` (when it was started) and forgets its state, so that its next use initialises it again. */
export async function resetBackend(name: BackendName): Promise<void> {
  const r = backends.get(name);
  if (!r) return;
  await r.pending;
  const wasUp = r.state?.ok === true;
  r.state = undefined;
  r.pending = undefined;
  if (wasUp) await r.entry.dispose?.();
}

/**
 * Releases every started backend (the WebGPU device above all, which keeps Node from exiting). Safe to call
 * more than once; a later call of any op starts the backend it needs again.
 */
export async function disposeBackends(): Promise<void> {
  for (const name of backends.keys()) await resetBackend(name);
}
