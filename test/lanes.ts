/**
 * The fast lane: `npm run test:unit` (vitest.config.ts's `unit` project) runs these files, the logic tests that start
 * no process (no Python, no CLI, no server, no Redis, no Chromium: test/helpers/unit-lane.ts makes any attempt fail)
 * and wait on no wall-clock lease or timeout, in about two minutes on 2 cores. Every other test file is the
 * `integration` project; `npm test` runs both, and test/lanes.test.ts checks that each file is in exactly one.
 */
export const UNIT_TESTS: readonly string[] = [
  'test/backend.test.ts',
  'test/binding.test.ts',
  'test/byte-level-bpe.test.ts',
  'test/exactness.test.ts',
  'test/folders.test.ts',
  'test/forest.test.ts',
  'test/import-cycles.test.ts',
  'test/io.test.ts',
  'test/loss-addon.test.ts',
  'test/loss-concurrency.test.ts',
  'test/loss-turns.test.ts',
  'test/loss-webgpu.test.ts',
  'test/loss.test.ts',
  'test/mask-parity.test.ts',
  'test/mask.test.ts',
  'test/microbatch.test.ts',
  'test/native.test.ts',
  'test/packer.test.ts',
  'test/prefix-plan.test.ts',
  'test/records.test.ts',
  'test/serve-log-delta.test.ts',
  'test/shared-prefix.test.ts',
  'test/timeline.test.ts',
  'test/tokenize.test.ts',
];
