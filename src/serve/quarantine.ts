/**
 * Poison records' dead letters: an episode whose records fail to pack is left out of its step (the rest of the
 * step, other tenants' groups included, is packed and trained; its group is trained without it) and kept here
 * with the reason, as the JSONL records `treepack pack` reads (or, where even those could not be made, its
 * recorded calls), for `GET /v1/quarantine`. In process the entries are appended to `quarantine.jsonl` in the
 * data directory, fsync'd before the step goes out; on the shared pool the step's publication writes them to Redis
 * in the same script (redis-feed.ts). Either way each is counted (`treepack_quarantined_total`) and logged once.
 */
import { existsSync, readFileSync } from 'node:fs';
import { open } from 'node:fs/promises';
import { LOG_MODE } from './log.js';
import type { Metrics } from './metrics.js';
import type { Episode } from './pool.js';

/** An episode packed out of its step, as the packer reports it. */
export interface Quarantined {
  episode: string;
  group: string;
  /** the packer's error */
  reason: string;
  /** the episode's JSONL records, as `treepack pack` reads them (reproduces `reason`) */
  records?: Record<string, unknown>[];
  /** where the records themselves could not be made: the episode's recorded calls */
  calls?: { kind: string; request: unknown; output: unknown }[];
}

/** A quarantined episode as listed: the step it was left out of, and when. */
export interface QuarantineEntry extends Quarantined {
  step: number;
  time: number;
}

/** What `/v1/feed` shows of an entry. */
export type QuarantineSummary = Pick<QuarantineEntry, 'step' | 'episode' | 'group' | 'reason'>;

/** entries `/v1/feed` lists (the newest); `GET /v1/quarantine` gives more, up to QUARANTINE_LIST_MAX */
export const QUARANTINE_FEED_LIST = 20;
export const QUARANTINE_LIST_MAX = 1000;

export const summary = (e: QuarantineEntry): QuarantineSummary => ({ step: e.step, episode: e.episode, group: e.group, reason: e.reason });

/** The quarantine entry of an episode its records could not be packed for. */
export function quarantined(ep: Episode, err: unknown, records: Record<string, unknown>[] | undefined): Quarantined {
  const q: Quarantined = { episode: ep.id, group: ep.group, reason: (err as Error).message };
  if (records) q.records = records;
  else q.calls = ep.calls.map((c) => ({ kind: c.kind, request: c.request, output: c.output }));
  return q;
}

/** Counts and logs newly quarantined entries (once each, by the service that packed their step). */
export function reportQuarantined(entries: readonly QuarantineEntry[], metrics: Metrics, warn: (m: string) => void): void {
  if (entries.length === 0) return;
  metrics.quarantined.inc(entries.length);
  for (const e of entries) {
    const which = `episode ${JSON.stringify(e.episode)} (group ${JSON.stringify(e.group)})`;
    warn(`step ${e.step}: ${which} quarantined, its group trained without it: ${e.reason}`);
  }
}

/** The in-process feed's quarantine: `quarantine.jsonl`, one entry a line. */
export class QuarantineFile {
  /** `${step}/${episode}` of every entry: a step packed again after a restart adds none twice */
  private readonly keys = new Set<string>();
  private latest: QuarantineSummary[] = [];
  count = 0;

  constructor(private readonly path: string) {
    for (const e of readEntries(path)) this.remember(e);
  }

  private remember(e: QuarantineEntry): boolean {
    const key = entryKey(e);
    if (this.keys.has(key)) return false;
    this.keys.add(key);
    this.count++;
    this.latest.push(summary(e));
    if (this.latest.length > 2 * QUARANTINE_FEED_LIST) this.latest = this.latest.slice(-QUARANTINE_FEED_LIST);
    return true;
  }

  /** Appends, durably, the entries not already there; resolves to those. */
  async add(entries: QuarantineEntry[]): Promise<QuarantineEntry[]> {
    const added = entries.filter((e) => this.remember(e));
    if (added.length === 0) return added;
    // A torn last line (a crash mid-append) ends at no newline: a leading one keeps the next entry whole.
    const fh = await open(this.path, 'a', LOG_MODE);
    try {
      await fh.appendFile('\n' + added.map((e) => JSON.stringify(e)).join('\n') + '\n');
      await fh.datasync();
    } finally {
      await fh.close();
    }
    return added;
  }

  summaries(): QuarantineSummary[] {
    return this.latest.slice(-QUARANTINE_FEED_LIST);
  }

  /** The newest `limit` entries, oldest first. */
  list(limit: number): QuarantineEntry[] {
    return readEntries(this.path).slice(-limit);
  }
}

const entryKey = (e: QuarantineEntry): string => `${e.step}/${e.episode}`;

/** The entries of a quarantine file, each once (a step packed again after a restart may have appended it again). */
function readEntries(path: string): QuarantineEntry[] {
  if (!existsSync(path)) return [];
  const out: QuarantineEntry[] = [];
  const keys = new Set<string>();
  for (const line of readFileSync(path, 'utf8').split('\n')) {
    if (line === '') continue;
    let e: QuarantineEntry;
    try {
      e = JSON.parse(line) as QuarantineEntry;
    } catch {
      continue; // a line torn by a crash mid-append: its step is packed again after the restart, and appends it again
    }
    if (!keys.has(entryKey(e))) out.push(e);
    keys.add(entryKey(e));
  }
  return out;
}
