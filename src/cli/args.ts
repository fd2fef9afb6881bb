/** Option parsing shared by the commands: node's parseArgs plus the checks that turn strings into values. */
import { parseArgs, type ParseArgsConfig } from 'node:util';
import { BACKEND_NAMES, type BackendName } from '../backend/index.js';
import { TreepackError } from '../errors.js';
import type { PackerOptions } from '../packer/index.js';

export interface Parsed {
  values: Record<string, string | boolean | undefined>;
  positionals: string[];
}

export function parse(argv: string[], options: NonNullable<ParseArgsConfig['options']>, usage: string): Parsed {
  try {
    const { values, positionals } = parseArgs({ args: argv, options: { ...options, help: { type: 'boolean', short: 'h' } }, allowPositionals: true, strict: true });
    return { values: values as Parsed['values'], positionals };
  } catch (err) {
    throw new TreepackError('E_ARG', `${(err as Error).message}\n\n${usage}`);
  }
}

export function positiveInt(name: string, v: string | undefined, fallback?: number): number | undefined {
  if (v === undefined) return fallback;
  const n = Number(v);
  if (!Number.isSafeInteger(n) || n < 1) throw new TreepackError('E_ARG', `Expected a positive integer for ${name} but received ${JSON.stringify(v)}`);
  return n;
}

export function nonNegativeNumber(name: string, v: string | undefined, fallback: number): number {
  if (v === undefined) return fallback;
  const n = Number(v);
  if (v.trim() === '' || !Number.isFinite(n) || n < 0) throw new TreepackError('E_ARG', `Expected a number >= 0 for ${name} but received ${JSON.stringify(v)}`);
  return n;
}

export function backendOption(v: string | undefined, name = '--backend'): BackendName | 'auto' {
  if (v === undefined || v === 'auto') return 'auto';
  if (!(BACKEND_NAMES as readonly string[]).includes(v)) {
    throw new TreepackError('E_ARG', `Expected one of auto, ${BACKEND_NAMES.join(', ')} for ${name} but received ${JSON.stringify(v)}`);
  }
  return v as BackendName;
}

export function oneInput(positionals: string[], usage: string): string {
  if (positionals.length !== 1) throw new TreepackError('E_ARG', `expected exactly one input (a JSONL file or - for stdin), got ${positionals.length}\n\n${usage}`);
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
} as const;

export function pipelineOptions(values: Parsed['values']): PackerOptions {
  return {
    tokenizer: values.tokenizer as string | undefined,
    backend: backendOption(values.backend as string | undefined),
    windowTokens: positiveInt('--max-naive-tokens', values['max-naive-tokens'] as string | undefined),
    vocabSize: positiveInt('--vocab-size', values['vocab-size'] as string | undefined),
    merge: values['no-merge'] ? false : { timelineCompareLevel: compareLevel(values['timeline-compare-level'] as string | undefined) },
  };
}

function compareLevel(v: string | undefined): 'text' | 'token' {
  if (v === undefined || v === 'text' || v === 'token') return v ?? 'text';
  throw new TreepackError('E_ARG', `Expected text or token for --timeline-compare-level but received ${JSON.stringify(v)}`);
}
