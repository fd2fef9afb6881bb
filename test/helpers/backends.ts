/**
 * One harness for every per-backend suite (tfjs's describeWithFlags): `await describeBackends(op, fn)` runs `fn`'s
 * suite once per backend that implements `op`. An unavailable backend is a skipped suite whose title and log say
 * why, unless the environment requires it (TREEPACK_REQUIRE_CUDA, TREEPACK_REQUIRE_WEBGPU, TREEPACK_REQUIRE_NATIVE
 * for cpu: CI sets those it can run), where it is a failing test instead. Backends are disposed after the file.
 */
import { afterAll, describe, expect, it } from 'vitest';
import { disposeBackends, listBackends, type BackendName, type BackendStatus, type OpName } from '../../src/backend/index.js';

export const REQUIRE_ENV: Record<BackendName, string | undefined> = {
  cuda: 'TREEPACK_REQUIRE_CUDA',
  webgpu: 'TREEPACK_REQUIRE_WEBGPU',
  cpu: 'TREEPACK_REQUIRE_NATIVE',
  js: undefined,
};

/** Whether the environment demands `backend` (its TREEPACK_REQUIRE_* variable is 1). */
export function required(backend: BackendName): boolean {
  const v = REQUIRE_ENV[backend];
  return v !== undefined && process.env[v] === '1';
}

export interface BackendSuiteOptions {
  /** Only these backends (a suite about one backend's own machinery). */
  only?: readonly BackendName[];
  /** The suite compares each backend with the js reference: js itself is left out rather than compared with itself. */
  againstJs?: boolean;
}

let disposing = false;

/**
 * Declares `${op} on ${backend}` for every backend that registers `op` (or any op of a list), in priority order.
 * Call it at the top level of a test file, with await.
 */
export async function describeBackends(
  op: OpName | readonly OpName[],
  fn: (backend: BackendName, status: BackendStatus) => void,
  opts: BackendSuiteOptions = {},
): Promise<void> {
  if (!disposing) {
    disposing = true;
    afterAll(disposeBackends);
  }
  const ops = typeof op === 'string' ? [op] : op;
  const title = ops.join(', ');
  for (const status of await listBackends()) {
    const { name } = status;
    if (!ops.some((o) => status.ops.includes(o))) continue;
    if (opts.only && !opts.only.includes(name)) continue;
    if (opts.againstJs && name === 'js') continue;
    if (status.available) {
      describe(`${title} on ${name}`, () => fn(name, status));
    } else if (required(name)) {
      describe(`${title} on ${name}`, () => {
        it(`is available (${REQUIRE_ENV[name]}=1)`, () => expect.fail(`${name} is required here but unavailable: ${status.detail}`));
      });
    } else {
      console.log(`${title} on ${name}: skipped, backend unavailable: ${status.detail}`);
      describe.skip(`${title} on ${name} (skipped: ${status.detail})`, () => fn(name, status));
    }
  }
}
