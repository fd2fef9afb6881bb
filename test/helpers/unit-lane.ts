/**
 * The unit lane's guard (test/helpers/unit-lane-setup.ts installs it before each file of vitest.config.ts's `unit`
 * project): while it is installed, every way `node:child_process` starts a process throws, so a unit-lane file cannot
 * start Python, a server, Redis, Chromium or the CLI, not even through a helper or a library (playwright and ioredis
 * use the same module object).
 * The file that tried fails, naming the call and the command, and belongs in the integration lane (test/lanes.ts).
 */
import childProcess from 'node:child_process';
import { syncBuiltinESMExports } from 'node:module';

const STARTERS = ['spawn', 'spawnSync', 'exec', 'execSync', 'execFile', 'execFileSync', 'fork'] as const;
type Starter = (typeof STARTERS)[number];

export class UnitLaneError extends Error {}

let saved: Record<Starter, unknown> | null = null;

/** Replaces the starters (idempotent); `import { spawn } from 'node:child_process'` sees the replacement too. */
export function installUnitLaneGuard(): void {
  if (saved) return;
  saved = Object.fromEntries(STARTERS.map((k) => [k, childProcess[k]])) as Record<Starter, unknown>;
  const cp = childProcess as unknown as Record<Starter, unknown>;
  for (const k of STARTERS) {
    cp[k] = (command: unknown, args?: unknown) => {
      const what = [command, ...(Array.isArray(args) ? args : [])].map(String).join(' ').slice(0, 200);
      throw new UnitLaneError(`the unit lane starts no process: child_process.${k}(${what}); move this file out of test/lanes.ts`);
    };
  }
  syncBuiltinESMExports();
}

export function removeUnitLaneGuard(): void {
  if (!saved) return;
  Object.assign(childProcess, saved);
  saved = null;
  syncBuiltinESMExports();
}
