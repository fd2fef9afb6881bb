/** scripts/python-env.mjs and the Python package's metadata. */
import { spawnSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { expect, it } from 'vitest';

const root = fileURLToPath(new URL('..', import.meta.url));

it('the Python package version is the npm package version', () => {
  const npm = JSON.parse(readFileSync(`${root}/package.json`, 'utf8')).version;
  const py = /^version = "([^"]+)"/m.exec(readFileSync(`${root}/python/pyproject.toml`, 'utf8'))?.[1];
  expect(py).toBe(npm);
});

it('TREEPACK_PYTHON names the interpreter; a missing one is reported, never replaced', { timeout: 60_000 }, () => {
  const run = (python: string) => {
    const r = spawnSync(process.execPath, ['scripts/python-env.mjs'], { cwd: root, encoding: 'utf8', env: { ...process.env, TREEPACK_PYTHON: python } });
    expect(r.status, r.stderr).toBe(0);
    return JSON.parse(r.stdout) as { python: string | null; torch: boolean; reason: string; source: string };
  };
  const missing = run('/nonexistent/python3');
  expect(missing).toMatchObject({ python: null, torch: false, source: 'TREEPACK_PYTHON' });
  expect(missing.reason).toMatch(/TREEPACK_PYTHON=\/nonexistent\/python3 not runnable/);
});
