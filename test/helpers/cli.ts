/** Runs the compiled `treepack` bin (built by `npm test`'s pretest step) as a user would. */
import { spawnSync } from 'node:child_process';
import { fileURLToPath } from 'node:url';

// import.meta.url, not __dirname: the bench (tsx, ES modules) imports the helpers too.
export const BIN = fileURLToPath(new URL('../../dist/src/cli/main.js', import.meta.url));

export function cli(args: string[], input?: string): { code: number | null; stdout: string; stderr: string } {
  const r = spawnSync(process.execPath, [BIN, ...args], { input, encoding: 'utf8' });
  return { code: r.status, stdout: r.stdout, stderr: r.stderr };
}
