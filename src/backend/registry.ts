/**
 * One registry for every backend (onnxruntime-node / tfjs style): backends register with a priority and a lazy
 * init; kernels register per (backend, op). Resolution walks backends by priority, initialising each at most
 * once (a failure is remembered with its reason and never retried), and returns the first that has the op,
 * together with a report of what was tried and why, so callers can say what ran.
 */
import { TreepackError } from '../errors.js';
import type { BlockMask, TreeArrays } from '../mask/types.js';
import type { LossConfig } from '../loss/config.js';
import type { CompactPlan, LossBatch, LossResult } from '../loss/types.js';
import type { Forest, Sequences } from '../pack/contract.js';

export type BackendName = 'cuda' | 'webgpu' | 'cpu' | 'js';
export const BACKEND_NAMES: readonly BackendName[] = ['cuda', 'webgpu', 'cpu', 'js'];

/** Every op a backend may implement. Later pipeline steps (masks, loss) add theirs here. */
export interface Kernels {
  packForest: (seqs: Sequences) => Forest;
  /** Mask lowerings (src/mask): async because GPU backends read their results back. */
  maskDense: (tree: TreeArrays) => Promise<Uint8Array>;
  maskBits: (tree: TreeArrays) => Promise<Uint32Array>;
  maskBlocks: (tree: TreeArrays, blockSize: number) => Promise<BlockMask>;
  maskSlices: (tree: TreeArrays) => Promise<Int32Array>;
  maskCuSeqlens: (tree: TreeArrays) => Promise<Int32Array>;
  /** Per-occurrence RL loss, gradient and metrics; inputs validated by src/loss (computeLoss). */
  loss: (batch: LossBatch, lp: Float32Array, cfg: LossConfig) => Promise<LossResult>;
  /** The same from a compact per-node plan (buildCompactPlan). */
  lossCompact: (plan: CompactPlan, lp: Float32Array, cfg: LossConfig) => Promise<LossResult>;
}
export type OpName = keyof Kernels;

export interface BackendStatus {
  name: BackendName;
  priority: number;
  available: boolean;
  /** Why it is unavailable, or what it runs on when available. */
  detail: string;
  ops: OpName[];
}

export interface Resolved<K extends OpName> {
  backend: BackendName;
  kernel: Kernels[K];
  /** The chosen backend and, before it, every higher-priority backend skipped and why. */
  report: string;
}

interface Entry {
  name: BackendName;
  priority: number;
  init: () => Promise<string> | string; // returns a description of what it runs on; throws when unavailable
  state?: { ok: true; detail: string } | { ok: false; detail: string };
  pending?: Promise<void>;
}

const backends = new Map<BackendName, Entry>();
const kernels = new Map<string, unknown>();

export function registerBackend(name: BackendName, priority: number, init: Entry['init']): void {
  if (backends.has(name)) throw new TreepackError('E_BACKEND', `backend '${name}' is already registered`);
  backends.set(name, { name, priority, init });
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

async function ensureInit(e: Entry): Promise<void> {
  if (e.state) return;
  e.pending ??= (async () => {
    try {
      e.state = { ok: true, detail: await e.init() };
    } catch (err) {
      e.state = { ok: false, detail: err instanceof Error ? err.message : String(err) };
    }
  })();
  await e.pending;
}

function sorted(): Entry[] {
  return [...backends.values()].sort((a, b) => b.priority - a.priority);
}

/** Status of every registered backend, initialising each (once). */
export async function listBackends(): Promise<BackendStatus[]> {
  const out: BackendStatus[] = [];
  for (const e of sorted()) {
    await ensureInit(e);
    out.push({ name: e.name, priority: e.priority, available: e.state!.ok, detail: e.state!.detail, ops: opsOf(e.name) });
  }
  return out;
}

/**
 * The kernel for `op`: on `preferred` when given (an error if it is unavailable or lacks the op: an explicit
 * choice is never silently replaced), else on the highest-priority available backend that implements it.
 */
export async function resolveKernel<K extends OpName>(op: K, preferred?: BackendName | 'auto'): Promise<Resolved<K>> {
  const skipped: string[] = [];
  for (const e of sorted()) {
    if (preferred && preferred !== 'auto' && e.name !== preferred) continue;
    const kernel = kernels.get(`${e.name}_${op}`) as Kernels[K] | undefined;
    if (!kernel) {
      skipped.push(`${e.name}: no '${op}' kernel`);
      continue;
    }
    await ensureInit(e);
    if (!e.state!.ok) {
      skipped.push(`${e.name}: ${e.state!.detail}`);
      continue;
    }
    const why = skipped.length ? ` (skipped ${skipped.join('; ')})` : '';
    return { backend: e.name, kernel, report: `${op} on ${e.name}: ${e.state!.detail}${why}` };
  }
  if (preferred && preferred !== 'auto' && !backends.has(preferred)) {
    throw new TreepackError('E_ARG', `Expected one of ${[...backends.keys()].join(', ')} for backend but received '${preferred}'`);
  }
  throw new TreepackError('E_BACKEND', `no available backend for '${op}': ${skipped.join('; ')}`);
}
