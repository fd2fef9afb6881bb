/**
 * A step's episodes → micro-batches, on the library packer: the episodes become the JSONL records
 * `treepack pack` reads (records.ts), in group order, and go through `packRecords` with the service's packer
 * options, so the service's micro-batches are exactly those of `treepack pack` on the same lines.
 */
import { microBatchBytes } from '../io/microbatch.js';
import { packRecords, type PackerOptions } from '../packer/index.js';
import type { ChatEncoder } from '../tokenize/chat.js';
import type { PackedOut } from './feed.js';
import type { Metrics } from './metrics.js';
import type { Episode } from './pool.js';
import { emptyRecordStats, episodeLines, type RecordStats } from './records.js';

export function stepPacker(encoder: ChatEncoder, packer: PackerOptions, metrics: Metrics, totals: RecordStats = emptyRecordStats()) {
  return async (episodes: Episode[]): Promise<PackedOut[]> => {
    const stats = emptyRecordStats();
    const lines = episodes.flatMap((ep) => episodeLines(ep, encoder, stats));
    for (const k of Object.keys(stats) as (keyof RecordStats)[]) {
      totals[k] += stats[k];
      if (stats[k]) metrics.prompts.inc({ tokens: k }, stats[k]);
    }
    const out: PackedOut[] = [];
    for await (const mb of packRecords(lines, { ...packer, name: 'service' })) {
      out.push({ bytes: microBatchBytes(mb), entry: { ...mb.entry } });
    }
    return out;
  };
}
