/**
 * Option parsing shared by the commands: node's parseArgs plus the checks that turn strings into values, and the
 * flags, parsing and --help lines of the packer's options, read from its option table (src/packer/option-table.ts).
 */
import { parseArgs, type ParseArgsConfig } from 'node:util';
import type { BackendName } from '../backend/index.js';
import { TreepackError } from '../errors.js';
import type { PackerOptions } from '../packer/index.js';
import { backendKind, groupOf, int, setPath, type OptionEntry, type ValueKind } from '../packer/option-table.js';

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
    const { values, positionals } = parseArgs({
      args: argv,
      options: { ...options, help: { type: 'boolean', short: 'h' } },
      allowPositionals: true,
      strict: true,
    });
    return { values: values, positionals };
  } catch (err) {
    throw usageError(`${(err as Error).message}\n\n${usage}`);
  }
}

/** A flag's text as the option's value: a bad one is a usage error naming the flag. */
export function flagValue(kind: ValueKind, flag: string, text: string): unknown {
  const v = kind.parse ? kind.parse(text) : text;
  if (!kind.test(v)) throw usageError(`Expected ${kind.expected} for ${flag} but received ${JSON.stringify(text)}`);
  optionValue(() => kind.resolve?.(v, flag)); // what only resolving can tell (--masks block:0)
  return v;
}

export function positiveInt(name: string, v: string | undefined, fallback?: number): number | undefined {
  return v === undefined ? fallback : (flagValue(int(1), name, v) as number);
}

export function backendOption(v: string | undefined, name = '--backend'): BackendName | 'auto' {
  return v === undefined ? 'auto' : (flagValue(backendKind, name, v) as BackendName | 'auto');
}

export function oneInput(positionals: string[], usage: string): string {
  if (positionals.length !== 1)
    throw usageError(`expected exactly one input (a JSONL file or - for stdin), got ${positionals.length}\n\n${usage}`);
  return positionals[0];
}

/** parseArgs's definitions of the entries' flags. */
export function optionFlags(entries: readonly OptionEntry[]): Record<string, { type: 'string' | 'boolean' }> {
  return Object.fromEntries(entries.map((e) => [e.flag.slice(2), { type: e.metavar ? 'string' : 'boolean' }]));
}

/** The packer options the given flags set, each checked as it is read; the library fills in the defaults. */
export function packerOptions(values: Parsed['values'], entries: readonly OptionEntry[]): PackerOptions {
  const o: Record<string, unknown> = {};
  const given = (e: OptionEntry) => values[e.flag.slice(2)] !== undefined;
  for (const e of entries.filter(given)) {
    const group = groupOf(e);
    if (group !== undefined && o[group] === false) continue; // --no-merge: the merge's own flags have nothing to set
    setPath(o, e.option, e.metavar ? flagValue(e.value, e.flag, values[e.flag.slice(2)] as string) : e.sets);
  }
  // A group's required option: any flag of the group needs it (--dp needs --max-tokens).
  for (const need of entries.filter((e) => e.required && !given(e))) {
    const group = groupOf(need);
    const stray = entries.find((e) => given(e) && groupOf(e) === group);
    if (stray) throw usageError(`${stray.flag} needs ${need.flag} ${need.metavar} (the ${group} it applies to)`);
  }
  return o;
}

/** One line or more of a --help's option list: the flag, its help, and a note such as `[default: 1]`. */
export interface HelpRow {
  flag: string;
  help: string;
  note?: string;
}

const HELP_WIDTH = 110;
const HELP_INDENT = 26;

/** Option lines of a --help: help text wrapped at HELP_WIDTH beside the flag, the note at the right margin. */
export function helpLines(rows: readonly HelpRow[]): string {
  const width = HELP_WIDTH - HELP_INDENT;
  const out: string[] = [];
  for (const { flag, help, note } of rows) {
    const text = wrap(help, width);
    if (note) {
      const last = text[text.length - 1] ?? '';
      if (last.length + 1 + note.length <= width) text[text.length - 1] = last.padEnd(width - note.length) + note;
      else text.push(note.padStart(width));
    }
    const head = `  ${flag}`;
    if (head.length > HELP_INDENT - 2) out.push(head, ...text.map((l) => ' '.repeat(HELP_INDENT) + l));
    else out.push(head.padEnd(HELP_INDENT) + text[0], ...text.slice(1).map((l) => ' '.repeat(HELP_INDENT) + l));
  }
  return out.join('\n');
}

/** The help rows of table entries: `--dp K`, its help, its default. */
export function optionHelp(entries: readonly OptionEntry[]): HelpRow[] {
  return entries.map((e) => {
    const shown = e.metavar && (typeof e.default === 'number' || typeof e.default === 'string') ? String(e.default) : undefined;
    return {
      flag: e.metavar ? `${e.flag} ${e.metavar}` : e.flag,
      help: e.help,
      note: shown === undefined ? undefined : `[default: ${shown}]`,
    };
  });
}

/** Words of `text` in lines of at most `width` characters (a longer word has a line of its own). */
export function wrap(text: string, width: number): string[] {
  const lines: string[] = [];
  let line = '';
  for (const word of text.split(/\s+/).filter(Boolean)) {
    if (line && line.length + 1 + word.length > width) {
      lines.push(line);
      line = word;
    } else line = line ? `${line} ${word}` : word;
  }
  lines.push(line);
  return lines;
}
