/** Runs the compiled `treepack` bin (built by `npm test`'s pretest step) as a user would. */
import { spawnSync } from 'node:child_process';
import { resolve } from 'node:path';

export const BIN = resolve(__dirname, '../../dist/src/cli/main.js');

export function cli(args: string[], input?: string): { code: number | null; stdout: string; stderr: string } {
  const r = spawnSync(process.execPath, [BIN, ...args], { input, encoding: 'utf8' });
  return { code: r.status, stdout: r.stdout, stderr: r.stderr };
}
