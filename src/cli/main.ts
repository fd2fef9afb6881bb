#!/usr/bin/env node
/** The `treepack` command: dispatches to one module per subcommand and turns errors into exit codes. */
import { disposeBackends } from '../backend/index.js';
import { EXIT_OK, EXIT_USAGE, exitStatus, TreepackError } from '../errors.js';
import { doctorCommand, DOCTOR_USAGE } from './doctor.js';
import { lossCommand, LOSS_USAGE } from './loss.js';
import { packCommand, PACK_USAGE } from './pack.js';
import { serveCommand, SERVE_USAGE } from './serve.js';
import { statsCommand, STATS_USAGE } from './stats.js';
import { VERSION } from '../version.js';

const USAGE = `Usage: treepack <command> [options]

Commands:
  pack <input|->     pack rollouts into prefix-tree micro-batches (safetensors + manifest.json)
  stats <input|->    report naive vs packed tokens, per group, and branch depths
  doctor             which backends (cuda, webgpu, cpu, js) can run here, and why not
  loss <mb>          RL loss, metrics and dloss/dlp of a dumped micro-batch and node logprobs
  serve              recording gateway, slime rollout buffer and trainer feed in front of an engine
  help [command]     help for a command

Run 'treepack <command> --help' for a command's options. Version ${VERSION}.`;

const commands: Record<string, { run: (argv: string[]) => Promise<number>; usage: string }> = {
  pack: { run: packCommand, usage: PACK_USAGE },
  stats: { run: statsCommand, usage: STATS_USAGE },
  doctor: { run: doctorCommand, usage: DOCTOR_USAGE },
  loss: { run: lossCommand, usage: LOSS_USAGE },
  serve: { run: serveCommand, usage: SERVE_USAGE },
};

async function main(argv: string[]): Promise<number> {
  const [cmd, ...rest] = argv;
  if (cmd === undefined || cmd === '--help' || cmd === '-h') {
    console.log(USAGE);
    return cmd === undefined ? EXIT_USAGE : EXIT_OK;
  }
  if (cmd === '--version' || cmd === '-v') {
    console.log(VERSION);
    return EXIT_OK;
  }
  if (cmd === 'help') {
    console.log(commands[rest[0]]?.usage ?? USAGE);
    return EXIT_OK;
  }
  const command = commands[cmd];
  if (!command) {
    console.error(`treepack: unknown command ${JSON.stringify(cmd)}\n\n${USAGE}`);
    return EXIT_USAGE;
  }
  try {
    return await command.run(rest);
  } catch (err) {
    if (err instanceof TreepackError) {
      console.error(`treepack ${cmd}: ${err.message}`);
      return exitStatus(err);
    }
    throw err;
  } finally {
    // A live WebGPU device (mask lowerings, doctor) keeps Node from exiting.
    await disposeBackends();
  }
}

// EPIPE on stdout (e.g. `treepack stats … | head`) is a normal way for a reader to stop.
process.stdout.on('error', (err: NodeJS.ErrnoException) => {
  if (err.code === 'EPIPE') process.exit(0);
  throw err;
});
process.exitCode = await main(process.argv.slice(2));
