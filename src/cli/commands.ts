/** The `treepack` subcommands and the top-level --help: what main.ts dispatches and docs/reference/cli.md lists. */
import { doctorCommand, DOCTOR_USAGE } from './doctor.js';
import { lossCommand, LOSS_USAGE } from './loss.js';
import { packCommand, PACK_USAGE } from './pack.js';
import { serveCommand, SERVE_USAGE } from './serve.js';
import { statsCommand, STATS_USAGE } from './stats.js';
import { VERSION } from '../version.js';

export const USAGE = `Usage: treepack <command> [options]

Commands:
  pack <input|->     pack rollouts into prefix-tree micro-batches (safetensors + manifest.json)
  stats <input|->    report naive vs packed tokens, per group, and branch depths
  doctor             which backends (cuda, webgpu, cpu, js) can run here, and why not
  loss <mb>          RL loss, metrics and dloss/dlp of a dumped micro-batch and node logprobs
  serve              recording gateway, slime rollout buffer and trainer feed in front of an engine
  help [command]     help for a command

Run 'treepack <command> --help' for a command's options. Version ${VERSION}.`;

export interface Command {
  run: (argv: string[]) => Promise<number>;
  usage: string;
}

/** In the order the top-level --help lists them. */
export const COMMANDS: Readonly<Record<string, Command>> = {
  pack: { run: packCommand, usage: PACK_USAGE },
  stats: { run: statsCommand, usage: STATS_USAGE },
  doctor: { run: doctorCommand, usage: DOCTOR_USAGE },
  loss: { run: lossCommand, usage: LOSS_USAGE },
  serve: { run: serveCommand, usage: SERVE_USAGE },
};
