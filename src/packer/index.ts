export { packRecords, type PackInput, type PackRun } from './pack-records.js';
export { createPacker, type Packer } from './incremental.js';
export type { PackedMicroBatch } from './core.js';
export { DEFAULT_WINDOW_TOKENS, type BudgetSettings, type PackerOptions } from './options.js';
export { manifestHeader, type PackReport } from './report.js';
