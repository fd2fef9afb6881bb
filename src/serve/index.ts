/**
 * `treepack/serve`: the recording gateway between agents and an inference engine, the slime-compatible rollout
 * buffer and the windowed-FIFO trainer feed, as `treepack serve` runs them (docs/guides/service.md).
 *
 * @module treepack/serve
 */
export { Service, startService, type ServiceOptions } from './service.js';
export type { FeedOptions, Handout } from './feed.js';
