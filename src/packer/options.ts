/**
 * The packer's options as a library caller gives them (and the CLI builds them from its flags), and their
 * resolution: every option with a flag is checked and defaulted from its entry in option-table.ts, so a bad option
 * is E_ARG naming the option before any input is read.
 */
import { argError } from '../errors.js';
import { copyRecords, getPath, groupOf, isRecord, OPTION_TABLE, setPath, type OptionEntry } from './option-table.js';
import type { PackerOptions, ResolvedOptions } from './types.js';

export type { BudgetSettings, PackerOptions, ResolvedOptions } from './types.js';

export { DEFAULT_WINDOW_TOKENS } from './option-table.js';

export function resolveOptions(o: PackerOptions = {}): ResolvedOptions {
  if (o === null || typeof o !== 'object') throw argError('options', 'an object', o);
  // Each value passed its entry's check (or is its default), so the table's result has the declared types.
  return { ...(resolveTable(o as Record<string, unknown>) as unknown as ResolvedOptions), onProgress: o.onProgress };
}

/** The table's options of `o`, checked (E_ARG naming the option) and completed with their defaults. */
function resolveTable(o: Record<string, unknown>): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const e of OPTION_TABLE) {
    const group = groupOf(e);
    if (group !== undefined) {
      if (!(group in out)) {
        // A group without an entry of its own (budget) is off unless given, and then an object.
        const given = o[group];
        if (given === undefined) continue;
        if (!isRecord(given)) throw argError(group, 'an object', given);
        out[group] = copyRecords(given); // the caller's other keys stay, as given
      }
      if (out[group] === false) continue; // turned off (merge: false): its options have nothing to set
      const parent = e.option.slice(0, e.option.lastIndexOf('.'));
      const level = getPath(o, parent); // budget.cost of budget.cost.a
      if (level !== undefined && !isRecord(level)) throw argError(parent, 'an object', level);
    }
    let v = getPath(o, e.option);
    if (v === undefined) {
      if (e.required) throw argError(e.option, e.value.expected, v);
      v = e.default;
      if (v === undefined) continue;
    } else if (!e.value.test(v)) {
      throw argError(e.option, e.value.expected, v);
    }
    // A group's object (merge) is copied, as its options are set into it; any other value is the caller's own.
    setPath(out, e.option, e.value.resolve ? e.value.resolve(v, e.option) : isGroup(e) ? copyRecords(v) : v);
  }
  return out;
}

const isGroup = (e: OptionEntry): boolean => OPTION_TABLE.some((x) => x.option.startsWith(`${e.option}.`));
