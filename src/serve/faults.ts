/**
 * Kill points for the crash tests: the process kills itself with SIGKILL at a named point when the test sets the
 * point's environment variable to it, so a test can stop the service exactly where a crash is hardest to survive.
 * Unset (always, outside tests), each point is one environment lookup.
 */
export function killPoint(variable: 'TREEPACK_SERVE_COMPACT_FAULT' | 'TREEPACK_SERVE_FORM_FAULT', at: string): void {
  if (process.env[variable] === at) process.kill(process.pid, 'SIGKILL');
}
