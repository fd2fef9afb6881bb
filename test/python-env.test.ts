/** scripts/python-env.mjs and the Python package's metadata. */
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { expect, it } from 'vitest';
import { createVenv } from '../scripts/python-env.mjs';

const root = fileURLToPath(new URL('..', import.meta.url));

it('the Python package version is the npm package version', () => {
  const npm = JSON.parse(readFileSync(`${root}/package.json`, 'utf8')).version;
  const py = /^version = "([^"]+)"/m.exec(readFileSync(`${root}/python/pyproject.toml`, 'utf8'))?.[1];
  expect(py).toBe(npm);
});

it('TREEPACK_PYTHON names the interpreter; a missing one is reported, never replaced', { timeout: 60_000 }, () => {
  const run = (python: string) => {
    const r = spawnSync(process.execPath, ['scripts/python-env.mjs'], {
      cwd: root,
      encoding: 'utf8',
      env: { ...process.env, TREEPACK_PYTHON: python },
    });
    expect(r.status, r.stderr).toBe(0);
    return JSON.parse(r.stdout) as { python: string | null; torch: boolean; reason: string; source: string };
  };
  const missing = run('/nonexistent/python3');
  expect(missing).toMatchObject({ python: null, torch: false, source: 'TREEPACK_PYTHON' });
  expect(missing.reason).toMatch(/TREEPACK_PYTHON=\/nonexistent\/python3 not runnable/);
});

it(
  'a venv it creates works through its own bin/pip: its scripts name the venv, not the folder it was built in',
  { timeout: 180_000 },
  (ctx) => {
    if (spawnSync('python3', ['-m', 'venv', '--help']).status !== 0) return ctx.skip('python3 with the venv module not found');
    const dir = mkdtempSync(join(tmpdir(), 'treepack-venv-'));
    try {
      const venv = join(dir, '.venv');
      // pip itself: already in a new venv, so nothing is fetched
      writeFileSync(join(dir, 'requirements.txt'), 'pip\n');
      expect(createVenv('python3', venv, join(dir, 'requirements.txt'))).toBe('');
      expect(readdirSync(dir).sort()).toEqual(['.venv', 'requirements.txt']); // the build folder is gone
      const pip = spawnSync(join(venv, 'bin', 'pip'), ['--version'], { encoding: 'utf8' });
      expect(pip.status, pip.stderr).toBe(0);
      expect(pip.stdout).toContain(join(venv, 'lib'));
      expect(readFileSync(join(venv, 'bin', 'activate'), 'utf8')).not.toContain('.building-');
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  },
);
