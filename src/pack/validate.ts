import { argError, TreepackError } from '../errors.js';
import type { Sequences } from './contract.js';

/** Checks the CSR shape of a batch of sequences; every backend relies on it and re-checks nothing in hot loops. */
export function validateSequences(seqs: Sequences): void {
  if (seqs === null || typeof seqs !== 'object') throw argError('sequences', 'an object {tokens, offsets}', seqs);
  const { tokens, offsets } = seqs;
  if (!(tokens instanceof Int32Array)) throw argError('sequences.tokens', 'an Int32Array', tokens);
  if (!(offsets instanceof Int32Array)) throw argError('sequences.offsets', 'an Int32Array', offsets);
  if (offsets.length < 1) throw argError('sequences.offsets', 'an Int32Array of length S+1 >= 1', offsets);
  if (offsets[0] !== 0) throw new TreepackError('E_ARG', `sequences.offsets[0] must be 0, got ${offsets[0]}`);
  const S = offsets.length - 1;
  for (let i = 0; i < S; i++) {
    if (offsets[i + 1] < offsets[i]) {
      throw new TreepackError(
        'E_ARG',
        `sequences.offsets must be non-decreasing: offsets[${i + 1}] = ${offsets[i + 1]} < offsets[${i}] = ${offsets[i]}`,
      );
    }
  }
  if (offsets[S] !== tokens.length) {
    throw new TreepackError('E_ARG', `sequences.offsets[S] = ${offsets[S]} must equal tokens.length = ${tokens.length}`);
  }
}
