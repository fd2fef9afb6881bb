/**
 * Where packed micro-batches go: `manifest.json` and the files it lists. A sink receives micro-batches in order
 * and publishes them with the manifest only on `commit`, so a failed run leaves nothing a reader would trust.
 * Readers resolve files as join(out, entry.file) for each manifest entry, never by listing the directory.
 */
import type { MicroBatch } from '../pack/contract.js';
import type { CostModel } from '../pack/balance.js';
import type { Tensor } from './safetensors.js';

/** The `format` of manifest.json (docs/reference/format.md, "Versioning"). */
export const MANIFEST_FORMAT = 'treepack/1';
/** The manifest's file name in an output directory: where every reader starts. */
export const MANIFEST_FILE = 'manifest.json';

/** One micro-batch of manifest.json (docs/reference/format.md, "micro_batches entries"). */
export interface ManifestEntry {
  file: string;
  sequences: number;
  naive_tokens: number;
  packed_tokens: number;
  /** with a token budget */
  rank?: number;
  step?: number;
  pad_tokens?: number;
  attention_pairs?: number;
  cost?: number;
  /** with prefix reuse (docs/concepts/micro-batching.md, "Step plans"): as the file's header says, and the tokens it computes and pushes */
  prefix_tokens?: number;
  prefix_push?: number[];
  prefix_release?: number;
  computed_tokens?: number;
  pushed_tokens?: number;
}

/** manifest.json, keys in the order they are written. */
export interface Manifest {
  format: typeof MANIFEST_FORMAT;
  /** DirectorySink: the generation of the directory this manifest commits (docs/operations/output-directory.md). */
  generation?: number;
  input: string;
  tokenizer: string;
  backend: string;
  /** with mask lowerings: their names as `--masks` spells them, and which backend built each */
  masks?: string[];
  mask_backend?: string[];
  records: number;
  timelines: number;
  absorbed: number;
  sequences: number;
  naive_tokens: number;
  packed_tokens: number;
  /** with a token budget */
  max_tokens?: number;
  dp?: number;
  pad_multiple?: number;
  cost_model?: CostModel;
  optimum_tokens?: number;
  rank_costs?: number[];
  imbalance?: number;
  /** with prefix reuse: the prefix cache per rank, and tokens computed with grad / pushed without it, over all ranks */
  prefix_cache_tokens?: number;
  prefix_bytes_per_token?: number;
  computed_tokens?: number;
  pushed_tokens?: number;
  peak_cached_tokens?: number;
  peak_cached_bytes?: number;
  /** with MoE routes: the --route-conflict policy, conflicting occurrences, packed tokens split vs by tokens alone */
  route_conflict?: 'split' | 'first';
  route_conflicts?: number;
  route_split_tokens?: number;
  route_unsplit_tokens?: number;
  micro_batches: ManifestEntry[];
}

/** manifest.json without its micro-batch list: what a sink is given at commit. */
export type ManifestHeader = Omit<Manifest, 'micro_batches'>;

/** Tensors and header entries outside the contract that travel in a micro-batch's file (mask lowerings). */
export interface ExtraTensors {
  tensors: ReadonlyMap<string, Tensor>;
  metadata: Readonly<Record<string, string>>;
}

/** What a sink is given per micro-batch: the batch, its mask lowerings and its manifest entry. */
export interface SinkMicroBatch {
  batch: MicroBatch;
  masks?: ExtraTensors;
  entry: ManifestEntry;
}

/** Where a run's micro-batches go; nothing is published before `commit`. */
export interface Sink {
  /** Prepares the destination; called once before the first write. */
  open(): void;
  write(mb: SinkMicroBatch): void;
  /** Publishes every written micro-batch under `header` + their entries; returns the manifest. */
  commit(header: ManifestHeader): Manifest;
  /** Drops everything written since `open`; a previous commit's output stays as it was. */
  abort(): void;
}

/** The file name of micro-batch `index`: microbatch-00000.safetensors. */
export const microBatchFileName = (index: number): string => `microbatch-${String(index).padStart(5, '0')}.safetensors`;

/** manifest.json as written: indented JSON and a final newline. */
export function manifestBytes(manifest: Manifest): Uint8Array {
  return Buffer.from(JSON.stringify(manifest, null, 2) + '\n');
}
