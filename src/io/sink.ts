/**
 * Where packed micro-batches go: `manifest.json` and the files it lists. A sink receives micro-batches in order
 * and publishes them with the manifest only on `commit`, so a failed run leaves nothing a reader would trust.
 * Readers resolve files as join(out, entry.file) for each manifest entry, never by listing the directory.
 */
import type { MicroBatch } from '../pack/contract.js';
import type { CostModel } from '../pack/balance.js';
import type { CandidateReport } from '../pack/planner.js';
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
  /**
   * with shared prefixes (docs/design.md §11): per pushed segment of prefix_push, the id of the shared piece (the
   * manifest's shared_prefixes) it is, or null for a segment its rank computes alone
   */
  prefix_shared?: (number | null)[];
  /** under context parallelism: the ranks that run it together; `rank` is the first */
  cp_ranks?: number[];
}

/** A prefix piece computed in shares by a data-parallel group (docs/design.md §11). */
export interface ManifestSharedPiece {
  /** referred to by micro-batches' prefix_shared; the index in shared_prefixes */
  id: number;
  /** the first step of its window: the group computes it before that step and releases it after the window's last */
  step: number;
  /** a sequence whose root path holds it, at depths [start, end) */
  sequence: string;
  start: number;
  end: number;
  /** the ranks holding it, ascending and contiguous */
  ranks: number[];
  /** per rank of `ranks`: the depth range [a, b) it computes; contiguous, together [start, end) */
  ranges: [number, number][];
}

/** The parallel planner's choice for one window (docs/design.md §11): its steps, the mode and the figures that decided. */
export interface ManifestParallelPlan {
  /** first step of the window and its number of steps */
  step: number;
  steps: number;
  mode: 'dp' | 'shared' | 'cp';
  cp: number;
  why: string;
  candidates: CandidateReport[];
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
  /** with shared prefixes: tokens of the shared pieces, each counted once in computed_tokens */
  shared_tokens?: number;
  /** with prefix reuse: the planner's options (see the CLI's --no-shared-prefix, --cp, --kv-bytes-per-token, --link-bytes-per-token) */
  shared_prefix?: boolean;
  cp?: number;
  kv_bytes_per_token?: number;
  link_bytes_per_token?: number;
  parallel_plans?: ManifestParallelPlan[];
  shared_prefixes?: ManifestSharedPiece[];
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
