/** Streaming JSONL line reader: memory is bounded by the longest line plus one chunk, never by the file. */
import { isUtf8 } from 'node:buffer';
import { createReadStream } from 'node:fs';
import type { Readable } from 'node:stream';
import { TreepackError } from '../errors.js';

export interface JsonlLine {
  line: number; // 1-based physical line number, blank lines included, so errors point into the file
  text: string;
}

export interface JsonlOptions {
  /** Longest accepted line in bytes (without its line break); a longer one is E_LIMIT. */
  maxLineBytes?: number;
  /** Name used in errors for a Readable input (a path names itself, `-` is stdin). */
  name?: string;
  /**
   * Decode invalid UTF-8 as U+FFFD instead of rejecting the line. Off by default: a replaced byte silently changes
   * text (a group or episode name, a message the tokenizer then sees).
   */
  lossyUtf8?: boolean;
}

export type JsonlInput = string | Readable;

const DEFAULT_MAX_LINE_BYTES = 256 * 1024 * 1024;

const LF = 0x0a;
const CR = 0x0d;

/** The name errors use for an input: the path, `-` for stdin, else `opts.name` or `<stream>`. */
export function inputName(input: JsonlInput, name?: string): string {
  return typeof input === 'string' ? input : (name ?? '<stream>');
}

function openInput(input: JsonlInput): Readable {
  if (input === '-') return process.stdin;
  if (typeof input === 'string') return createReadStream(input, { highWaterMark: 1 << 20 });
  return input;
}

/**
 * Yields the non-blank lines of a JSONL input. Lines are split on raw bytes (0x0A never occurs inside a UTF-8
 * multi-byte sequence) and decoded only once complete, so a character split across chunks is never mangled.
 */
export async function* readJsonlLines(input: JsonlInput, opts: JsonlOptions = {}): AsyncGenerator<JsonlLine> {
  const file = inputName(input, opts.name);
  const maxLineBytes = opts.maxLineBytes ?? DEFAULT_MAX_LINE_BYTES;
  const stream = openInput(input);
  let pending: Buffer[] = [];
  let pendingBytes = 0;
  let line = 0;
  let lineStart = 0; // byte offset of the current line in the input

  const tooLong = (): TreepackError =>
    new TreepackError('E_LIMIT', `line longer than ${maxLineBytes} bytes (maxLineBytes); is this a JSONL file with one record per line?`, {
      file,
      line: line + 1,
    });

  const finish = (tail: Buffer): JsonlLine | undefined => {
    let total = pendingBytes + tail.length;
    if ((tail.length > 0 ? tail.at(-1) : pending.at(-1)?.at(-1)) === CR) total--;
    if (total > maxLineBytes) throw tooLong();
    line++;
    let buf = pending.length === 0 ? tail : Buffer.concat([...pending, tail], pendingBytes + tail.length);
    const at = lineStart;
    lineStart += buf.length + 1;
    pending = [];
    pendingBytes = 0;
    let start = 0;
    if (line === 1 && total >= 3 && buf[0] === 0xef && buf[1] === 0xbb && buf[2] === 0xbf) start = 3;
    if (start !== 0 || total !== buf.length) buf = buf.subarray(start, total);
    if (!opts.lossyUtf8 && !isUtf8(buf)) {
      const bad = start + firstInvalidUtf8(buf);
      throw new TreepackError(
        'E_INPUT',
        `invalid UTF-8 at byte ${bad} of the line (byte ${at + bad} of the input); fix the encoding, or pass --lossy-utf8 (lossyUtf8) to read it as U+FFFD`,
        { file, line },
      );
    }
    const text = buf.toString('utf8');
    return /\S/.test(text) ? { line, text } : undefined;
  };

  // An early `return()` from the consumer ends the for-await loop, which destroys the stream: no fd leaks.
  try {
    for await (const chunk of stream) {
      const buf: Buffer = typeof chunk === 'string' ? Buffer.from(chunk, 'utf8') : (chunk as Buffer);
      let from = 0;
      for (let nl = buf.indexOf(LF, from); nl >= 0; nl = buf.indexOf(LF, from)) {
        const got = finish(buf.subarray(from, nl));
        from = nl + 1;
        if (got) yield got;
      }
      if (from < buf.length) {
        pending.push(buf.subarray(from));
        pendingBytes += buf.length - from;
        // +1: the byte may be the CR of a CRLF, which is not content; finish() checks exactly.
        if (pendingBytes > maxLineBytes + 1) throw tooLong();
      }
    }
  } catch (e) {
    if (e instanceof TreepackError) throw e;
    throw new TreepackError('E_IO', `cannot read: ${(e as Error).message}`, { file });
  }
  if (pendingBytes > 0) {
    const got = finish(Buffer.alloc(0));
    if (got) yield got;
  }
}

/**
 * Offset of the first byte that does not start or continue a well-formed UTF-8 sequence (RFC 3629: no overlongs, no
 * surrogates, ≤ U+10FFFF).
 */
export function firstInvalidUtf8(b: Uint8Array): number {
  let i = 0;
  while (i < b.length) {
    const c = b[i];
    if (c < 0x80) {
      i++;
      continue;
    }
    let n: number;
    let lo = 0x80;
    let hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) n = 1;
    else if (c >= 0xe0 && c <= 0xef) {
      n = 2;
      if (c === 0xe0) lo = 0xa0;
      else if (c === 0xed) hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      n = 3;
      if (c === 0xf0) lo = 0x90;
      else if (c === 0xf4) hi = 0x8f;
    } else return i;
    for (let k = 1; k <= n; k++) {
      const d = b[i + k];
      if (d === undefined || d < (k === 1 ? lo : 0x80) || d > (k === 1 ? hi : 0xbf)) return i;
    }
    i += n + 1;
  }
  return b.length;
}
