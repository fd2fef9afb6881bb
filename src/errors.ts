/**
 * One error class for everything treepack rejects, so callers can branch on `code` and the CLI can print
 * `where` (file:line, field) without parsing messages. The native addon receives this class at load time and
 * throws it too, so errors look the same whichever backend ran.
 */
export type ErrorCode =
  | 'E_INPUT' // malformed or inconsistent input data (JSON, lengths, values)
  | 'E_ARG' // bad argument to an API call (or a bad value in a config file the CLI read)
  | 'E_USAGE' // the command line itself: unknown option, malformed or missing option value
  | 'E_LIMIT' // a size over a documented limit
  | 'E_IO' // reading or writing files
  | 'E_BACKEND'; // a backend could not be loaded or failed

/**
 * The CLI's exit status, one table for every command: 0 success; 2 bad usage, i.e. what the command line alone
 * shows to be wrong (unknown command or option, malformed or missing option value), found before any input is
 * read; 1 everything else: bad input files (data, micro-batches, logprobs, config files), a size limit, a file
 * system or backend failure.
 */
export const EXIT_OK = 0;
export const EXIT_FAILURE = 1;
export const EXIT_USAGE = 2;

export function exitStatus(err: TreepackError): number {
  return err.code === 'E_USAGE' ? EXIT_USAGE : EXIT_FAILURE;
}

export interface ErrorWhere {
  file?: string;
  line?: number;
  record?: string;
  field?: string;
}

export class TreepackError extends Error {
  readonly code: ErrorCode;
  readonly where: ErrorWhere;
  /** The message without the location prefix. */
  readonly detail: string;
  constructor(code: ErrorCode, message: string, where: ErrorWhere = {}) {
    super(formatWhere(where) + message);
    this.name = 'TreepackError';
    this.code = code;
    this.where = where;
    this.detail = message;
  }
}

function formatWhere(w: ErrorWhere): string {
  const parts: string[] = [];
  if (w.file !== undefined) parts.push(w.line !== undefined ? `${w.file}:${w.line}` : w.file);
  else if (w.line !== undefined) parts.push(`line ${w.line}`);
  if (w.record !== undefined) parts.push(`record ${JSON.stringify(w.record)}`);
  if (w.field !== undefined) parts.push(`field ${JSON.stringify(w.field)}`);
  return parts.length ? parts.join(', ') + ': ' : '';
}

/** "Expected <what> for <name> but received <value> of type <type>" (sharp's wording). */
export function describeValue(v: unknown): string {
  if (v === null) return 'null';
  if (Array.isArray(v)) return `an array of length ${v.length}`;
  if (ArrayBuffer.isView(v)) return `${v.constructor.name} of length ${(v as unknown as { length: number }).length}`;
  const t = typeof v;
  if (t === 'string') {
    const s = v as string;
    return `${JSON.stringify(s.length > 40 ? s.slice(0, 40) + '…' : s)} of type string`;
  }
  if (t === 'object') return 'an object';
  return `${String(v)} of type ${t}`;
}

export function argError(name: string, expected: string, received: unknown): TreepackError {
  return new TreepackError('E_ARG', `Expected ${expected} for ${name} but received ${describeValue(received)}`);
}
