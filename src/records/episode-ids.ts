/**
 * One episode_id, one episode: an episode line (`requests`) whose id an earlier, different line already used is an
 * error naming both lines, since merging them would silently turn two rollouts into one (a GRPO group would count
 * one episode fewer and every advantage of the group would change). A byte-identical repeat is the same episode.
 * `repeatedEpisodeIds` turns the check off where lines sharing an id are deliberately parts of one episode.
 */
import { createHash } from 'node:crypto';
import { TreepackError } from '../errors.js';
import type { TrainRecord } from './types.js';

export class EpisodeIds {
  /** episode_id → the first line that used it and a digest of that line */
  readonly #seen = new Map<string, { line: number; digest: string }>();

  /** Checks the records of one parsed line; `text` is the line as read (or the value's JSON for objects). */
  check(value: unknown, records: readonly TrainRecord[], text: string, file: string, line: number): void {
    const first = records[0];
    if (first?.kind !== 'chat' || value === null || typeof value !== 'object' || !('requests' in value)) return;
    const digest = createHash('sha1').update(text).digest('base64');
    const seen = this.#seen.get(first.episode);
    if (seen === undefined) this.#seen.set(first.episode, { line, digest });
    else if (seen.digest !== digest) {
      throw new TreepackError(
        'E_INPUT',
        `episode_id ${JSON.stringify(first.episode)} was already used by a different episode on line ${seen.line}; episode ids must be unique (pass --repeated-episode-ids, or repeatedEpisodeIds, if lines sharing an id are parts of one episode)`,
        { file, line, record: first.episode, field: 'episode_id' },
      );
    }
  }
}
