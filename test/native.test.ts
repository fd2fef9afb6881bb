import fs from 'node:fs';
import { describe, expect, it } from 'vitest';
import { cudaDeviceInfo, type ForestBuffers, loadCuda, loadNative, packForestNative } from '../src/backend/native.js';
import { TreepackError } from '../src/errors.js';
import type { Forest, Sequences } from '../src/pack/contract.js';
import { packForest } from '../src/pack/forest.js';
import { describeBackends } from './helpers/backends.js';
import { caught } from './helpers/errors.js';
import { csr, rng, shuffle } from './helpers/sequences.js';

const FIELDS = ['input_ids', 'position_ids', 'parent', 'subtree_end', 'seq_offsets', 'seq_positions'] as const;

function bytes(a: Int32Array): Buffer {
  return Buffer.from(a.buffer, a.byteOffset, a.byteLength);
}

/** Byte equality of every array, reporting the first differing field and index rather than a huge diff. */
function expectSameForest(actual: Forest, expected: Forest): void {
  for (const f of FIELDS) {
    expect(actual[f], f).toBeInstanceOf(Int32Array);
    expect(actual[f].length, `${f}.length`).toBe(expected[f].length);
    if (!bytes(actual[f]).equals(bytes(expected[f]))) {
      const i = actual[f].findIndex((v, k) => v !== expected[f][k]);
      expect.fail(`${f}[${i}] = ${actual[f][i]}, expected ${expected[f][i]}`);
    }
  }
}

function expectMatchesJs(seqs: Sequences, out?: ForestBuffers): Forest {
  const got = packForestNative(seqs, out);
  expectSameForest(got, packForest(seqs));
  return got;
}

/**
 * Small alphabets (signed extremes included) so that sequences share prefixes, repeat and prefix each other; long
 * sequences and point mutations put mismatches anywhere inside the native packer's 16-token compare steps.
 */
function randomBatch(rand: () => number): Sequences {
  const alphabets = [
    [0, 1],
    [1, 2, 3],
    [-2147483648, -1, 0, 2147483647],
    [5, 6, 7, 8, 9, 10, 11],
  ];
  const alphabet = alphabets[Math.floor(rand() * alphabets.length)];
  const S = Math.floor(rand() * 40);
  const maxLen = 1 + Math.floor(rand() * (rand() < 0.5 ? 12 : 120));
  const seqs: number[][] = [];
  for (let i = 0; i < S; i++) {
    const r = rand();
    if (seqs.length > 0 && r < 0.15) {
      seqs.push([...seqs[Math.floor(rand() * seqs.length)]]); // duplicate
    } else if (seqs.length > 0 && r < 0.3) {
      const s = seqs[Math.floor(rand() * seqs.length)];
      seqs.push(s.slice(0, Math.floor(rand() * (s.length + 1)))); // prefix
    } else if (seqs.length > 0 && r < 0.55) {
      const s = [...seqs[Math.floor(rand() * seqs.length)]];
      if (s.length > 0) s[Math.floor(rand() * s.length)] = alphabet[Math.floor(rand() * alphabet.length)];
      seqs.push(s); // point mutation
    } else if (seqs.length > 0 && r < 0.7) {
      const s = seqs[Math.floor(rand() * seqs.length)];
      const ext = Array.from({ length: Math.floor(rand() * maxLen) }, () => alphabet[Math.floor(rand() * alphabet.length)]);
      seqs.push([...s, ...ext]); // extension, as in agent chains
    } else {
      seqs.push(Array.from({ length: Math.floor(rand() * (maxLen + 1)) }, () => alphabet[Math.floor(rand() * alphabet.length)]));
    }
  }
  return csr(seqs);
}

/** Episodes of requests where request k+1 extends request k, all behind one system prompt. */
function agentBatch(rand: () => number, episodes: number, requests: number, system: number, step: number): number[][] {
  const prompt = Array.from({ length: system }, () => Math.floor(rand() * 1000));
  const seqs: number[][] = [];
  for (let e = 0; e < episodes; e++) {
    let cur = [...prompt];
    for (let r = 0; r < requests; r++) {
      const grow = 1 + Math.floor(rand() * 2 * step);
      cur = [...cur, ...Array.from({ length: grow }, () => Math.floor(rand() * 1000))];
      seqs.push(cur);
    }
  }
  return seqs;
}

const native = loadNative();

// The addon's own API (output buffers, argument checks) beside the registry's packForest kernel.
await describeBackends(
  'packForest',
  () => {
    it('reports the package version', () => {
      const pkg = JSON.parse(fs.readFileSync(new URL('../package.json', import.meta.url), 'utf8'));
      if ('error' in native) throw new Error(native.error);
      expect(native.binding.version()).toBe(pkg.version);
    });

    it('equals the js reference on random small-alphabet batches', () => {
      const rand = rng(12345);
      for (let trial = 0; trial < 600; trial++) {
        const batch = randomBatch(rand);
        expectMatchesJs(batch);
        // The same multiset in sorted and reverse sorted order exercises the ascending and descending runs.
        const S = batch.offsets.length - 1;
        const seqs = Array.from({ length: S }, (_, i) => batch.tokens.subarray(batch.offsets[i], batch.offsets[i + 1]));
        const order = Array.from({ length: S }, (_, i) => i).sort((a, b) => {
          const x = seqs[a],
            y = seqs[b];
          for (let t = 0; t < Math.min(x.length, y.length); t++) if (x[t] !== y[t]) return x[t] - y[t];
          return x.length - y.length;
        });
        expectMatchesJs(csr(order.map((i) => seqs[i])));
        expectMatchesJs(csr(order.reverse().map((i) => seqs[i])));
      }
    });

    it('handles the edge cases: empty batch, empty sequences, single token, prefixes', () => {
      expect(expectMatchesJs(csr([])).input_ids.length).toBe(0);
      expect(expectMatchesJs(csr([[], [], []])).input_ids.length).toBe(0);
      expectMatchesJs(csr([[], [7], [], [7]]));
      expect(expectMatchesJs(csr([[42]])).parent).toEqual(new Int32Array([-1]));
      expectMatchesJs(
        csr([
          [1, 2, 3, 4],
          [1, 2],
        ]),
      );
      expectMatchesJs(
        csr([
          [1, 2],
          [1, 2, 3, 4],
        ]),
      );
      expectMatchesJs(csr([[3, 2, 1], [3, 2], [3], []]));
      expect(
        expectMatchesJs(
          csr([
            [1, 2, 3],
            [1, 2, 3],
          ]),
        ).input_ids.length,
      ).toBe(3);
    });

    it('handles a very deep batch: 200k tokens plus its prefixes', () => {
      const rand = rng(7);
      const long = Array.from({ length: 200_000 }, () => Math.floor(rand() * 3));
      const lengths = [0, 1, 2, 1000, 65_536, 100_000, 199_999, 200_000];
      for (let i = 0; i < 40; i++) lengths.push(Math.floor(rand() * 200_001));
      const got = expectMatchesJs(
        csr(
          shuffle(
            lengths.map((n) => long.slice(0, n)),
            rand,
          ),
        ),
      );
      expect(got.input_ids.length).toBe(200_000);
      expect(got.subtree_end[0]).toBe(200_000);
    });

    it('handles sequences past the 65,536-token path buffer and short branches off them', () => {
      const rand = rng(14);
      const long = Array.from({ length: 150_000 }, () => Math.floor(rand() * 1000));
      const branch = (at: number) => [...long.slice(0, at), 1000 + at];
      const seqs = [
        long,
        long.slice(0, 65_536),
        long.slice(0, 65_537),
        branch(70_000),
        branch(65_535),
        branch(20_000),
        branch(100_000),
        long.slice(0, 10),
        branch(3),
      ];
      expectMatchesJs(csr(seqs));
      expectMatchesJs(csr(shuffle(seqs, rand)));
      // Sorted: a short sequence, the long one diverging from it at once, then a branch sharing 60k tokens with it.
      expectMatchesJs(csr([branch(30_000), [-5, 1, 2, 3], branch(60_000), long]));
    });

    it('handles a very wide batch: 10k sequences diverging at token 1', () => {
      const rand = rng(8);
      const seqs = Array.from({ length: 10_000 }, (_, i) => [
        7,
        i,
        ...Array.from({ length: Math.floor(rand() * 5) }, () => Math.floor(rand() * 4)),
      ]);
      const got = expectMatchesJs(csr(shuffle(seqs, rand)));
      expect(got.subtree_end[0]).toBe(got.input_ids.length);
    });

    it('handles agent-shaped chains in order, shuffled and reversed', () => {
      const rand = rng(9);
      const seqs = agentBatch(rand, 12, 9, 300, 40);
      expectMatchesJs(csr(seqs));
      expectMatchesJs(csr([...seqs].reverse()));
      expectMatchesJs(csr(shuffle([...seqs], rand)));
    });

    it('streams the outputs of a batch over 32 MiB: chains, a truncated chain, equal, prefix, empty, descending', () => {
      // Past 32 MiB of output (kStreamBytes in native/core/forest.cc) the core writes whole cache lines with
      // non-temporal stores and builds seq_positions from the path's segments instead of copying the previous sequence.
      const rand = rng(13);
      const piece = (n: number) => Int32Array.from({ length: n }, () => Math.floor(rand() * 150_000));
      const concat = (parts: Int32Array[]) => {
        const out = new Int32Array(parts.reduce((n, p) => n + p.length, 0));
        let at = 0;
        for (const p of parts) {
          out.set(p, at);
          at += p.length;
        }
        return out;
      };
      const system = piece(3001);
      const seqs: Int32Array[] = [new Int32Array(0), system.slice(0, 1)];
      for (let e = 0; e < 48; e++) {
        const turns = [system, piece(61)];
        const episode: Int32Array[] = [];
        for (let k = 0; k < 28; k++) {
          // From turn 20 on, the context keeps only the system prompt and the last 6 turns, which breaks the chain.
          episode.push(concat(k < 20 ? turns : [system, ...turns.slice(-6)]));
          turns.push(piece(15 + Math.floor(rand() * 400)));
        }
        if (e % 5 === 1) episode.reverse(); // a descending run
        if (e % 7 === 2) episode.splice(3, 0, episode[3].slice()); // equal neighbours
        if (e % 9 === 4) episode.splice(5, 0, episode[5].slice(0, 3001 + 61 + 7)); // a prefix of its neighbour, cut mid-turn
        seqs.push(...episode);
      }
      seqs.push(system.slice(), new Int32Array(0));
      // Sequences past the layout's 65,536-token path buffer, and a short branch that follows one in sorted order.
      const long = concat([system, piece(100_000)]);
      seqs.push(long, concat([long, piece(10)]), long.slice(0, 70_000), concat([long.slice(0, 53_001), Int32Array.of(200_000)]));
      const batch = csr(seqs);
      const expected = packForest(batch);
      const M = batch.tokens.length,
        N = expected.input_ids.length;
      expect(4 * M + 16 * N).toBeGreaterThan(32 << 20);
      expectSameForest(packForestNative(batch), expected);
      // Views 1 to 5 elements past a cache line's start put partial lines at both ends of every run.
      const out: ForestBuffers = {};
      FIELDS.forEach((f, i) => {
        const need = f === 'seq_offsets' ? seqs.length + 1 : f === 'seq_positions' ? M : N;
        out[f] = new Int32Array(need + 8).subarray(1 + i, 1 + i + need);
      });
      expectSameForest(packForestNative(batch, out), expected);
      expectMatchesJs(csr([...seqs].reverse()));
    });

    it('writes into reused output buffers and returns views of the needed length', () => {
      const rand = rng(10);
      const cap = 50_000;
      const out = {
        input_ids: new Int32Array(cap),
        position_ids: new Int32Array(cap),
        parent: new Int32Array(cap),
        subtree_end: new Int32Array(cap),
        seq_positions: new Int32Array(cap + 3),
        seq_offsets: new Int32Array(1000),
      };
      for (let trial = 0; trial < 20; trial++) {
        const batch = trial % 2 ? randomBatch(rand) : csr(agentBatch(rand, 4, 5, 100, 30));
        const got = expectMatchesJs(batch, out);
        for (const f of FIELDS) expect(got[f].buffer, f).toBe(out[f].buffer);
      }
      // Exact-length buffers come back as themselves; arrays left out are allocated.
      const batch = csr([
        [1, 2, 3],
        [1, 2, 4],
      ]);
      const exact = { input_ids: new Int32Array(4), seq_positions: new Int32Array(6) };
      const got = expectMatchesJs(batch, exact);
      expect(got.input_ids).toBe(exact.input_ids);
      expect(got.seq_positions).toBe(exact.seq_positions);
      // A view into a larger buffer at an offset is honoured.
      const big = new Int32Array(64).fill(-9);
      const view = big.subarray(8, 20);
      expectMatchesJs(batch, { parent: view });
      expect(big[7]).toBe(-9);
      expect(Array.from(big.subarray(8, 12))).toEqual([-1, 0, 1, 1]);
    });

    it('rejects bad input with TreepackError', () => {
      if ('error' in native) throw new Error(native.error);
      const { binding } = native;
      const tokens = new Int32Array([1, 2, 3]);
      const offsets = new Int32Array([0, 1, 3]);
      const expectError = (f: () => unknown, code: string, message: RegExp) => {
        const err = caught(f);
        expect(err).toBeInstanceOf(TreepackError);
        expect((err as TreepackError).code).toBe(code);
        expect((err as TreepackError).message).toMatch(message);
      };
      // Through the loader: validated in TypeScript first.
      expectError(
        () => packForestNative({ tokens: [1, 2, 3] as unknown as Int32Array, offsets }),
        'E_ARG',
        /Int32Array for sequences.tokens/,
      );
      expectError(() => packForestNative({ tokens, offsets: new Int32Array([0, 1, 2]) }), 'E_ARG', /must equal tokens.length/);
      expectError(() => packForestNative({ tokens, offsets: new Int32Array([0, 2, 1, 3]) }), 'E_ARG', /non-decreasing/);
      // The addon re-checks on its own.
      expectError(
        () => binding.packForest(new Float32Array(3) as unknown as Int32Array, offsets),
        'E_ARG',
        /Expected an Int32Array for tokens/,
      );
      expectError(() => binding.packForest(tokens, [0, 3] as unknown as Int32Array), 'E_ARG', /Expected an Int32Array for offsets/);
      expectError(() => binding.packForest(tokens, new Int32Array(0)), 'E_ARG', /length S\+1 >= 1/);
      expectError(() => binding.packForest(tokens, new Int32Array([0, 1, 2])), 'E_ARG', /offsets\[S\] must equal the number of tokens/);
      expectError(() => binding.packForest(tokens, new Int32Array([0, 2, 1, 3])), 'E_ARG', /non-decreasing/);
      expectError(() => binding.packForest(tokens, new Int32Array([1, 3])), 'E_ARG', /offsets\[0\] must be 0/);
      expectError(() => binding.packForest(tokens, offsets, 5 as unknown as ForestBuffers), 'E_ARG', /object of Int32Arrays for out/);
      expectError(
        () => binding.packForest(tokens, offsets, { parent: new Uint32Array(3) as unknown as Int32Array }),
        'E_ARG',
        /Int32Array for out.parent/,
      );
      expectError(
        () => binding.packForest(tokens, offsets, { input_ids: new Int32Array(2) }),
        'E_ARG',
        /out.input_ids has length 2 but needs at least 3/,
      );
      expectError(() => binding.packForest(tokens, offsets, { seq_offsets: offsets }), 'E_ARG', /shares memory with the input/);
      const shared = new Int32Array(16);
      expectError(
        () => binding.packForest(tokens, offsets, { parent: shared.subarray(0, 4), subtree_end: shared.subarray(2, 8) }),
        'E_ARG',
        /out.subtree_end shares memory with out.parent/,
      );
    });
  },
  { only: ['cpu'] },
);

describe('cuda loader', () => {
  it('reports availability without throwing', () => {
    const info = cudaDeviceInfo();
    if (info.available) expect(info.devices.length).toBeGreaterThan(0);
    else expect(info.reason).toMatch(/CUDA/);
  });

  const cuda = loadCuda();
  const cudaSkip = 'error' in cuda ? cuda.error : '';
  it.skipIf(cudaSkip !== '')(`gathers on the GPU or reports why not${cudaSkip ? ` (skipped: ${cudaSkip})` : ''}`, () => {
    if ('error' in cuda) throw new Error(cuda.error);
    const src = new Int32Array([10, 11, 12, 13]);
    const idx = new Int32Array([3, 0, 0, 2, 7, -1]);
    if (cudaDeviceInfo().available) {
      expect(Array.from(cuda.binding.gatherI32(src, idx))).toEqual([13, 10, 10, 12, 0, 0]);
    } else {
      expect(() => cuda.binding.gatherI32(src, idx)).toThrow(TreepackError);
    }
  });
});
