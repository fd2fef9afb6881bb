/** Option parsing shared by the commands: node's parseArgs plus the checks that turn strings into values. */
import { parseArgs, type ParseArgsConfig } from 'node:util';
import { BACKEND_NAMES, type BackendName } from '../backend/index.js';
import { TreepackError } from '../errors.js';
import type { PackerOptions } from '../packer/index.js';

export interface Parsed {
  values: Record<string, string | boolean | undefined>;
  positionals: string[];
}

/** An error in the command line itself (exit status 2, see errors.ts). */
export function usageError(message: string): TreepackError {
  return new TreepackError('E_USAGE', message);
}

/** Runs the parsing of an option's value by a library function, its argument errors being usage errors. */
export function optionValue<T>(parseValue: () => T): T {
  try {
    return parseValue();
  } catch (err) {
    if (err instanceof TreepackError && err.code === 'E_ARG') throw new TreepackError('E_USAGE', err.detail, err.where);
    throw err;
  }
}

export function parse(argv: string[], options: NonNullable<ParseArgsConfig['options']>, usage: string): Parsed {
  try {
    const { values, positionals } = parseArgs({ args: argv, options: { ...options, help: { type: 'boolean', short: 'h' } }, allowPositionals: true, strict: true });
    return { values: values as Parsed['values'], positionals };
  } catch (err) {
    throw usageError(`${(err as Error).message}\n\n${usage}`);
  }
}

export function positiveInt(name: string, v: string | undefined, fallback?: number): number | undefined {
  if (v === undefined) return fallback;
  const n = Number(v);
  if (!Number.isSafeInteger(n) || n < 1) throw usageError(`Expected a positive integer for ${name} but received ${JSON.stringify(v)}`);
  return n;
}

export function nonNegativeNumber(name: string, v: string | undefined, fallback: number): number {
  if (v === undefined) return fallback;
  const n = Number(v);
  if (v.trim() === '' || !Number.isFinite(n) || n < 0) throw usageError(`Expected a number >= 0 for ${name} but received ${JSON.stringify(v)}`);
  return n;
}

export function backendOption(v: string | undefined, name = '--backend'): BackendName | 'auto' {
  if (v === undefined || v === 'auto') return 'auto';
  if (!(BACKEND_NAMES as readonly string[]).includes(v)) {
    throw usageError(`Expected one of auto, ${BACKEND_NAMES.join(', ')} for ${name} but received ${JSON.stringify(v)}`);
  }
  return v as BackendName;
}

export function oneInput(positionals: string[], usage: string): string {
  if (positionals.length !== 1) throw usageError(`expected exactly one input (a JSONL file or - for stdin), got ${positionals.length}\n\n${usage}`);
  return positionals[0];
}

/** The options every command that runs the pipeline takes (see PACK_USAGE for their help text). */
export const PIPELINE_OPTIONS = {
  tokenizer: { type: 'string' },
  backend: { type: 'string' },
  'max-naive-tokens': { type: 'string' },
  'vocab-size': { type: 'string' },
  'no-merge': { type: 'boolean' },
  'timeline-compare-level': { type: 'string' },
  'repeated-episode-ids': { type: 'boolean' },
  'lossy-utf8': { type: 'boolean' },
} as const;

export function pipelineOptions(values: Parsed['values']): PackerOptions {
  return {
    tokenizer: values.tokenizer as string | undefined,
    backend: backendOption(values.backend as string | undefined),
    windowTokens: positiveInt('--max-naive-tokens', values['max-naive-tokens'] as string | undefined),
    vocabSize: positiveInt('--vocab-size', values['vocab-size'] as string | undefined),
    merge: values['no-merge'] ? false : { timelineCompareLevel: compareLevel(values['timeline-compare-level'] as string | undefined) },
    ...(values['repeated-episode-ids'] && { repeatedEpisodeIds: true }),
    ...(values['lossy-utf8'] && { lossyUtf8: true }),
  };
}

function compareLevel(v: string | undefined): 'text' | 'token' {
  if (v === undefined || v === 'text' || v === 'token') return v ?? 'text';
  throw usageError(`Expected text or token for --timeline-compare-level but received ${JSON.stringify(v)}`);
}
