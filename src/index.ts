/**
 * treepack: prefix-tree packing of multi-turn agent rollouts.
 *
 * The pipeline is `packRecords` (or `createPacker` for records that arrive one by one): records → timelines →
 * merged samples → advantages → windows → micro-batches, written by a sink (`DirectorySink`: files and
 * manifest.json, as `treepack pack` writes them). Each step is also exported on its own.
 *
 * The heavy parts are subpath exports, so importing the packer loads none of their dependencies:
 * `treepack/ops` (the kernels one at a time on a chosen backend, and the loss on a backend) and `treepack/serve`
 * (the recording gateway and trainer feed: fastify, ioredis, prom-client).
 *
 * @module treepack
 */
export { TreepackError, type ErrorCode, type ErrorWhere } from './errors.js';
export * from './pack/contract.js';
export type { ChatMessage, ChatRecord, Routes, Sample, Source, ToolCall, TrainRecord } from './records/types.js';
export { parseRoutes } from './records/routes.js';
export { packForest, sortSequences } from './pack/forest.js';
export { assembleMicroBatch, concatSequences, toSequences } from './pack/batch.js';
export { branchDepthHistogram } from './pack/shape.js';
export { readRecords } from './records/read.js';
export { loadTokenizer, type TextTokenizer } from './tokenize/tokenizer.js';
export { ChatEncoder } from './tokenize/chat.js';
export { mergeDefaults, AUTHORS, type Author, type MergeOptions, type Timeline, type TimelineMessage } from './timeline/model.js';
export { timelineFromChat, timelineFromSample, timelineToSample } from './timeline/build.js';
export { mergeTimelines, snapsOnly, type MergeReport, type MergeResult } from './timeline/merge.js';
export type { Snap, SnapKind } from './timeline/snap.js';
export {
  createPacker,
  packRecords,
  manifestHeader,
  DEFAULT_WINDOW_TOKENS,
  type Packer,
  type PackInput,
  type PackRun,
  type PackedMicroBatch,
  type PackerOptions,
  type BudgetSettings,
  type PackReport,
} from './packer/index.js';
export { DirectorySink } from './io/directory-sink.js';
export { MemorySink } from './io/memory-sink.js';
export {
  MANIFEST_FILE,
  MANIFEST_FORMAT,
  microBatchFileName,
  manifestBytes,
  type Manifest,
  type ManifestEntry,
  type ManifestHeader,
  type ManifestParallelPlan,
  type ManifestSharedPiece,
  type Sink,
  type SinkMicroBatch,
  type ExtraTensors,
} from './io/sink.js';
export { microBatchBytes, readMicroBatch, writeMicroBatch, type MicroBatchFile } from './io/microbatch.js';
export { readManifest, microBatchPaths, readMicroBatches, type DirectoryMicroBatch } from './io/manifest.js';
export { openPublish, type PublishRun } from './io/publish.js';
export { readSafetensors, writeSafetensors } from './io/safetensors.js';
export { checkForest } from './pack/invariants.js';
export * from './mask/index.js';
export { maskTensors, type MaskTensors } from './io/masks.js';
export { planMicroBatches, type BudgetOptions, type MicroBatchPlan, type Plan, type PlannedSharedPiece } from './pack/budget.js';
export type { CandidateReport, ParallelMode, StepChoice } from './pack/planner.js';
export { packWindow, padForest, type BudgetedMicroBatch, type WindowOptions } from './pack/window.js';
export {
  assignRanks,
  attentionPairs,
  imbalance,
  microBatchCost,
  pathPairs,
  DEFAULT_COST,
  type CostModel,
  type RankAssignment,
} from './pack/balance.js';
export { lcpQuery } from './pack/lcp.js';
export { Collector, simulateCollector, type CollectorPolicy, type ScheduleReport, type SimulatedGroup } from './pack/schedule.js';
export { BACKEND_NAMES, type BackendName } from './backend/index.js';
export { VERSION } from './version.js';
export {
  buildCompactPlan,
  resolveLossConfig,
  validateLossInputs,
  episodeAdvantages,
  sampleAdvantages,
  DEFAULT_LOSS_CONFIG,
  ADVANTAGE_ESTIMATORS,
  type LossConfig,
  type LossResult,
  type LossMetrics,
  type LossBatch,
  type CompactPlan,
  type AdvantageEstimator,
} from './loss/index.js';
