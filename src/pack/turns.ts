/**
 * Turn ids (the contract's `turn_ids` extension): per token of a sample, which of its assistant turns it belongs to,
 * so that a loss can aggregate per turn after the turns of a trajectory were merged into one sequence (Flow-GRPO,
 * src/loss/aggregate.ts). A turn is an assistant ('llm') message; a token gets the number of turns starting at or
 * before its message, minus one: −1 before the first turn, and the id of the turn it follows for tool or user tokens
 * (never trainable). The ids never decrease along a sample, so a turn is a run of equal ids.
 */
import type { Author, Sample } from '../records/types.js';

/** Turn ids of `length` tokens cut into messages starting at `starts` (first 0, non-decreasing), `isTurn` per message. */
export function turnIds(length: number, starts: ArrayLike<number>, isTurn: (message: number) => boolean): Int32Array {
  const out = new Int32Array(length);
  let id = -1;
  for (let m = 0; m < starts.length; m++) {
    if (isTurn(m)) id++;
    out.fill(id, starts[m], m + 1 < starts.length ? starts[m + 1] : length);
  }
  return out;
}

/**
 * A sample's turn ids: those the timeline gave it, else from its message boundaries (an author defaults to 'llm'
 * for a message with a trainable token, as in timelineFromSample); undefined without boundaries.
 */
export function sampleTurnIds(s: Sample): Int32Array | undefined {
  if (s.turn_ids) return s.turn_ids;
  const starts = s.message_offsets;
  if (!starts) return undefined;
  const author = (m: number): Author => {
    if (s.message_authors) return s.message_authors[m];
    const end = m + 1 < starts.length ? starts[m + 1] : s.tokens.length;
    return s.loss_mask.subarray(starts[m], end).includes(1) ? 'llm' : 'env';
  };
  return turnIds(s.tokens.length, starts, (m) => author(m) === 'llm');
}
