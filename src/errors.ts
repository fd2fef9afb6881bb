/**
 * One error class for everything treepack rejects, so callers can branch on `code` and the CLI can print
 * `where` (file:line, field) without parsing messages. The native addon receives this class at load time and
 * throws it too, so errors look the same whichever backend ran.
 */
export type ErrorCode =
  | 'E_INPUT' // malformed or inconsistent input data (JSON, lengths, values)
  | 'E_ARG' // bad argument to an API call or CLI option
  | 'E_LIMIT' // a size over a documented limit
  | 'E_IO' // reading or writing files
  | 'E_BACKEND'; // a backend could not be loaded or failed

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
