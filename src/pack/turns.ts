/**
 * Turn ids (the contract's `turn_ids` extension): per token of a sample, which of its assistant turns it belongs to,
 * so that a loss can aggregate per turn after the turns of a trajectory were merged into one sequence (Flow-GRPO,
 * src/loss/aggregate.ts). A turn is an assistant ('llm') message; a token gets the number of turns starting at or
 * before it, minus one: −1 before the first turn, and the id of the turn it follows for tool or user tokens (never
 * trainable). The ids never decrease along a sample, so a turn is a run of equal ids.
 */
import type { Sample } from '../records/types.js';

/** Turn ids of `length` tokens whose turns start at `starts` (non-decreasing token offsets). */
export function turnIds(length: number, starts: ArrayLike<number>): Int32Array {
  const out = new Int32Array(length).fill(-1);
  for (let k = 0; k < starts.length; k++) out.fill(k, starts[k], k + 1 < starts.length ? starts[k + 1] : length);
  return out;
}

/**
 * Where a sample's turns start: as the timeline gave them, else its 'llm' messages (an author defaults to 'llm' for
 * a message with a trainable token, as in timelineFromSample); undefined without message boundaries.
 */
export function turnStarts(s: Sample): ArrayLike<number> | undefined {
  if (s.turn_starts) return s.turn_starts;
  const starts = s.message_offsets;
  if (!starts) return undefined;
  const isTurn = (m: number): boolean => {
    if (s.message_authors) return s.message_authors[m] === 'llm';
    const end = m + 1 < starts.length ? starts[m + 1] : s.tokens.length;
    return s.loss_mask.subarray(starts[m], end).includes(1);
  };
  return Array.from(starts).filter((_, m) => isTurn(m));
}

/** A sample's turn ids; undefined without message boundaries. */
export function sampleTurnIds(s: Sample): Int32Array | undefined {
  const starts = turnStarts(s);
  return starts && turnIds(s.tokens.length, starts);
}
