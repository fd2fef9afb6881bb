#!/usr/bin/env node
/** The `treepack` command: dispatches to one module per subcommand and turns errors into exit codes. */
import { disposeBackends } from '../backend/index.js';
import { EXIT_OK, EXIT_USAGE, exitStatus, TreepackError } from '../errors.js';
import { COMMANDS, USAGE } from './commands.js';
import { VERSION } from '../version.js';

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
    console.log(COMMANDS[rest[0]]?.usage ?? USAGE);
    return EXIT_OK;
  }
  const command = COMMANDS[cmd];
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
