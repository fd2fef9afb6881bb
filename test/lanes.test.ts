/**
 * The two test lanes stay honest (test/lanes.ts): vitest itself, asked which files each project runs, puts every test
 * file of the repository in exactly one lane, the unit lane's list names only files that exist, and the unit lane's
 * guard is in its setup and refuses to start a process. (A unit-lane file that starts one fails in every run of the
 * unit project, `npm test` included, through that guard.)
 */
import { spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, relative } from 'node:path';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import config from '../vitest.config.js';
import { installUnitLaneGuard, removeUnitLaneGuard, UnitLaneError } from './helpers/unit-lane.js';
import { UNIT_TESTS } from './lanes.js';

const ROOT = fileURLToPath(new URL('..', import.meta.url));
const VITEST = join(ROOT, 'node_modules/vitest/vitest.mjs');
/** Where no test of this project lives: dependencies, environments, build outputs. */
const NOT_SOURCE = new Set([
  'node_modules',
  '.git',
  '.venv',
  '.venv-fla',
  '.cache',
  'dist',
  'build',
  'build-cmake',
  'build-emu',
  'build-emu-asan',
]);

/** Every file under the repository named like a test to vitest or to a person (`*.test.*`, `*.spec.*`). */
function testFilesOnDisk(dir = ROOT): string[] {
  const out: string[] = [];
  for (const e of readdirSync(dir, { withFileTypes: true })) {
    if (e.isDirectory()) {
      if (!NOT_SOURCE.has(e.name)) out.push(...testFilesOnDisk(join(dir, e.name)));
    } else if (/\.(test|spec)\.[cm]?[jt]sx?$/.test(e.name)) {
      out.push(relative(ROOT, join(dir, e.name)));
    }
  }
  return out.sort();
}

describe('test lanes', () => {
  it('vitest runs every test file in exactly one lane, the unit lane being test/lanes.ts', () => {
    const dir = mkdtempSync(join(tmpdir(), 'treepack-lanes-'));
    try {
      const json = join(dir, 'files.json');
      const args = [VITEST, 'list', '--filesOnly', `--json=${json}`];
      const r = spawnSync(process.execPath, args, { cwd: ROOT, encoding: 'utf8', timeout: 110_000 });
      expect(r.status, r.stderr).toBe(0);
      const found = JSON.parse(readFileSync(json, 'utf8')) as { file: string; projectName: string }[];
      const listed = found.map((x) => ({ file: relative(ROOT, x.file), lane: x.projectName }));
      const lanes = new Map<string, string[]>();
      for (const { file, lane } of listed) lanes.set(file, [...(lanes.get(file) ?? []), lane]);
      const onDisk = testFilesOnDisk();
      const wrong = onDisk.filter((f) => (lanes.get(f) ?? []).length !== 1).map((f) => `${f}: ${JSON.stringify(lanes.get(f) ?? [])}`);
      expect(wrong, 'test files in no lane or in both').toEqual([]);
      expect([...lanes.keys()].sort()).toEqual(onDisk);
      expect(
        listed
          .filter((x) => x.lane === 'unit')
          .map((x) => x.file)
          .sort(),
      ).toEqual([...UNIT_TESTS].sort());
      expect(new Set(listed.map((x) => x.lane))).toEqual(new Set(['unit', 'integration']));
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  }, 120_000);

  it('lists each unit file once, and only files that exist', () => {
    expect(new Set(UNIT_TESTS).size).toBe(UNIT_TESTS.length);
    expect(UNIT_TESTS.filter((f) => !existsSync(join(ROOT, f)))).toEqual([]);
  });

  it('sets up the unit lane with the guard, and the guard refuses every way to start a process', async () => {
    const unit = config.test?.projects?.find((p) => typeof p === 'object' && 'test' in p && p.test?.name === 'unit');
    const setup = unit && typeof unit === 'object' && 'test' in unit ? unit.test?.setupFiles : undefined;
    expect(setup).toEqual(['test/helpers/unit-lane-setup.ts']);
    const cp = await import('node:child_process');
    installUnitLaneGuard();
    try {
      // The named imports of this file see the guard too (the live ESM bindings a test file's imports use).
      expect(() => spawnSync('python3', ['-c', 'pass'])).toThrow(UnitLaneError);
      expect(() => spawnSync('python3', ['-c', 'pass'])).toThrow(/child_process\.spawnSync\(python3 -c pass\)/);
      for (const start of [cp.spawn, cp.exec, cp.execSync, cp.execFile, cp.execFileSync, cp.fork] as ((c: string) => unknown)[]) {
        expect(() => start(process.execPath)).toThrow(UnitLaneError);
      }
    } finally {
      removeUnitLaneGuard();
    }
    expect(spawnSync(process.execPath, ['-e', 'process.exit(3)']).status).toBe(3);
  });
});
