/**
 * Test budgets. No test measures speed (speed goals live in `npm run bench`), but many spawn the CLI, load the
 * Qwen3 tokenizer or run WGSL on a software adapter; on a busy host (two busy loops on two cores, see
 * scripts/test-under-load.sh) such a test takes many times its idle duration, so the default budget is 120 s, not
 * vitest's 5 s. Tests that are heavier still give their own budget.
 *
 * Two lanes (test/lanes.ts): `unit`, the fast one (`npm run test:unit`), whose files may start no process, and
 * `integration`, every other test file. `npm test` runs both.
 */
import { defineConfig } from 'vitest/config';
import { UNIT_TESTS } from './test/lanes.js';

export default defineConfig({
  test: {
    testTimeout: 120_000,
    hookTimeout: 120_000,
    projects: [
      { extends: true, test: { name: 'unit', include: [...UNIT_TESTS], setupFiles: ['test/helpers/unit-lane-setup.ts'] } },
      { extends: true, test: { name: 'integration', include: ['test/**/*.test.ts'], exclude: [...UNIT_TESTS] } },
    ],
  },
});
