/**
 * One error class for everything treepack rejects, so callers can branch on `code` and the CLI can print
 * `where` (file:line, field) without parsing messages. The native addon receives this class at load time and
 * throws it too, so errors look the same whichever backend ran.
 */
/**
 * Every code a TreepackError carries, with what it means and what to do about it: the one table the TypeScript
 * type, Python's treepack.errors (same strings) and docs/reference/errors.md (scripts/gen-docs.ts) are read from.
 */
export const ERROR_CODES = {
  E_INPUT: {
    meaning: 'malformed or inconsistent input data: JSON, lengths, values of a record, a micro-batch file or a manifest',
    action: 'fix the input at the file, line, record and field the message names; a file of another run or version is refused here too',
  },
  E_ARG: {
    meaning: 'a bad argument to an API call, or a bad value in a config file the CLI read',
    action: 'pass a value of the kind the message names ("Expected <what> for <name> but received <value>")',
  },
  E_USAGE: {
    meaning: 'the command line itself: unknown command or option, a malformed or missing option value (exit status 2)',
    action: 'run the command with --help; the message names the flag',
  },
  E_LIMIT: {
    meaning: 'a size over a documented limit: more than 2^31 - 1 tokens, an output array larger than the backend can hold',
    action: 'split the input (a token budget: --max-tokens), or use a backend with more memory',
  },
  E_IO: {
    meaning: 'reading or writing files failed: missing, not permitted, no space, a read-only file system, another writer',
    action: "fix the path or the file system the message names (it quotes the system's reason)",
  },
  E_BACKEND: {
    meaning: 'a backend could not be loaded or failed while running (a missing addon, no GPU driver, a CUDA runtime error)',
    action: 'run `treepack doctor` for what can run here and why not; choose another backend or rebuild the native parts',
  },
} as const satisfies Record<string, { meaning: string; action: string }>;

/** The code of a TreepackError: one of ERROR_CODES (docs/reference/errors.md). */
export type ErrorCode = keyof typeof ERROR_CODES;

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

/** Where an error is: the file and line of the input, the record id, the field; each part when known. */
export interface ErrorWhere {
  file?: string;
  line?: number;
  record?: string;
  field?: string;
}

/** The one error class of treepack: `code` to branch on, `where` to point at, `detail` the message without the location. */
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
  if (typeof v === 'string') return `${JSON.stringify(v.length > 40 ? v.slice(0, 40) + '…' : v)} of type string`;
  if (typeof v === 'object') return 'an object';
  if (typeof v === 'number' || typeof v === 'boolean' || typeof v === 'bigint' || typeof v === 'symbol' || v === undefined) {
    return `${String(v)} of type ${typeof v}`;
  }
  return 'a function';
}

export function argError(name: string, expected: string, received: unknown): TreepackError {
  return new TreepackError('E_ARG', `Expected ${expected} for ${name} but received ${describeValue(received)}`);
}
