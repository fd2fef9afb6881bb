/**
 * The trainer side on the oldest supported releases: .venv-oldest (scripts/python-env.mjs oldestEnv) holds the
 * pins of python/requirements-oldest.txt, the lower bounds of python/pyproject.toml's extras, over .venv's other
 * packages; the installed wheel runs a representative part of python/tests/trainer there (test/python-torch.test.ts
 * runs all of it on the newest, in .venv). Skipped, with the reason printed, where .venv-oldest or the wheel cannot
 * be had; under TREEPACK_REQUIRE_OLDEST=1 (CI) that fails instead, and no test of those modules may skip but the
 * CUDA-only ones. About 3.5 minutes on a busy 2-core host (45 tests), plus a minute to create .venv-oldest once.
 */
import { spawnSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { oldestEnv, pythonEnv, wheelEnv } from '../scripts/python-env.mjs';
import { pythonDir, pythonTests } from './helpers/python.js';

/**
 * The suites run on the oldest versions (docs/guides/pytorch.md#tested-versions says which): the version checks,
 * what touches transformers' internals (the attention function with windows and sinks, the dense mask mapping, the
 * patched recurrent layers of hybrid models, the wrapped forward under FSDP), packed-equals-unpacked on every
 * weight, and the TRL integration against TRL's own trainer. The loader, loss and step-plan suites, which do not
 * reach transformers' or TRL's code, run on the newest only.
 */
const OLDEST_SUITES = ['test_versions', 'test_exactness', 'test_window', 'test_hybrid', 'test_fsdp', 'test_trl_grpo'];

const env = pythonEnv();
const oldest = env.torch && env.python ? oldestEnv(env.python) : { python: null, reason: env.reason };
const wheel = oldest.python ? wheelEnv(oldest.python) : { python: null, wheel: '', reason: oldest.reason };
const skipReason = wheel.python ? '' : wheel.reason;
if (skipReason && process.env.TREEPACK_REQUIRE_OLDEST === '1') {
  throw new Error(`test/python-versions.test.ts: TREEPACK_REQUIRE_OLDEST=1 but ${skipReason}`);
}
if (skipReason) console.log(`test/python-versions.test.ts skipped: ${skipReason}`);

/** {package: version} pinned by python/requirements-oldest.txt. */
function pins(): Record<string, string> {
  const text = readFileSync(join(pythonDir, 'requirements-oldest.txt'), 'utf8');
  return Object.fromEntries([...text.matchAll(/^([A-Za-z0-9_.-]+)==(\S+)/gm)].map((m) => [m[1], m[2]]));
}

/** The installed wheel's Python outside python/, the suites' directory on its path (their `support` sits there). */
function run(args: string[], timeout: number) {
  const inherited = { ...process.env };
  delete inherited.PYTHONPATH;
  return spawnSync(wheel.python!, args, {
    cwd: tmpdir(),
    // One thread: the models are tiny, and on a shared, busy host more threads only contend.
    env: { ...inherited, PYTHONPATH: join(pythonTests, 'trainer'), PYTHONDONTWRITEBYTECODE: '1', OMP_NUM_THREADS: '1' },
    encoding: 'utf8',
    maxBuffer: 64 << 20,
    timeout,
  });
}

describe.skipIf(skipReason !== '')('the trainer side on the oldest supported transformers and TRL (.venv-oldest)', () => {
  it('runs the pinned oldest releases, not the newest', { timeout: 120_000 }, () => {
    const code =
      'import json, torch, transformers, trl; print(json.dumps({m.__name__: m.__version__ for m in (torch, transformers, trl)}))';
    const res = run(['-c', code], 110_000);
    expect(res.status, res.stderr.slice(-2000)).toBe(0);
    const got = JSON.parse(res.stdout.trim().split('\n').pop()!) as Record<string, string>;
    const want = pins();
    expect(Object.keys(want).sort()).toEqual(['torch', 'transformers', 'trl']);
    // torch's local label (2.13.0+cpu) is the same release.
    for (const [name, version] of Object.entries(want)) expect(got[name].split('+')[0], name).toBe(version);
    console.log(
      `.venv-oldest: ${Object.entries(got)
        .map(([k, v]) => `${k} ${v}`)
        .join(', ')}`,
    );
  });

  it(`${OLDEST_SUITES.join(', ')} pass there, none skipped but the CUDA-only ones`, { timeout: 900_000 }, () => {
    const started = Date.now();
    const res = run(['-m', 'unittest', '-v', ...OLDEST_SUITES], 890_000);
    const log = res.stderr;
    expect(res.status, log.slice(-4000)).toBe(0);
    expect(log).toMatch(/\nOK\b/);
    const ran = Number(/\nRan (\d+) tests?/.exec(log)?.[1] ?? 0);
    const skipped = log.match(/^.* \.\.\. skipped .*$/gm) ?? [];
    console.log(
      `.venv-oldest: ${ran} tests of ${OLDEST_SUITES.length} modules in ${((Date.now() - started) / 1000).toFixed(0)} s; skipped: ${skipped.join('; ')}`,
    );
    // Only the tests that need a CUDA device may skip here (as in test/python-torch.test.ts).
    expect(skipped.filter((line) => !/CUDA/.test(line))).toEqual([]);
    // Every named module ran tests (a module that failed to import would be one error, caught above).
    for (const suite of OLDEST_SUITES) expect(log, suite).toMatch(new RegExp(`\\(${suite}\\.`));
  });
});
