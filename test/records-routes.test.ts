/** The record field `routes` (MoE routing replay): both spellings, the unrouted last token, every rejection. */
import { describe, expect, it } from 'vitest';
import { TreepackError } from '../src/errors.js';
import { parseRecords } from '../src/records/read.js';
import { parseRoutes } from '../src/records/routes.js';
import type { Sample } from '../src/records/types.js';

const where = { file: 'r.jsonl', line: 3, record: 'rec-1' };

/** Routes [T][layers][k] as the compact form of `dtype`, encoded independently of the parser (Buffer writes). */
function compact(nested: number[][][], dtype: 'uint8' | 'int16' | 'int32'): { dtype: string; shape: number[]; data: string } {
  const flat = nested.flat(2);
  const size = { uint8: 1, int16: 2, int32: 4 }[dtype];
  const buf = Buffer.alloc(flat.length * size);
  flat.forEach((x, i) => (size === 1 ? buf.writeUInt8(x, i) : size === 2 ? buf.writeInt16LE(x, 2 * i) : buf.writeInt32LE(x, 4 * i)));
  return { dtype, shape: [nested.length, nested[0]?.length ?? 1, nested[0]?.[0]?.length ?? 1], data: buf.toString('base64') };
}

function rejected(value: unknown, tokens: number): TreepackError {
  try {
    parseRoutes(value, tokens, where);
  } catch (e) {
    expect(e).toBeInstanceOf(TreepackError);
    return e as TreepackError;
  }
  throw new Error('expected a rejection');
}

// 3 tokens, 2 layers, top-2
const R = [
  [
    [3, 7],
    [0, 5],
  ],
  [
    [1, 2],
    [6, 4],
  ],
  [
    [300, 0],
    [9, 8],
  ],
];

describe('parseRoutes', () => {
  it('reads the nested and every compact spelling to the same row-major int16 experts', () => {
    const expected = Int16Array.from(R.flat(2));
    for (const v of [R, compact(R, 'int16'), compact(R, 'int32')]) {
      const r = parseRoutes(v, 3, where);
      expect([r.layers, r.topK]).toEqual([2, 2]);
      expect(r.experts).toEqual(expected);
    }
    const small = R.map((t) => t.map((l) => l.map((e) => e % 256)));
    expect(parseRoutes(compact(small, 'uint8'), 3, where).experts).toEqual(Int16Array.from(small.flat(2)));
  });

  it('leaves the last token unrouted (−1) when the engine routed one token fewer (vLLM)', () => {
    for (const v of [R, compact(R, 'int32')]) {
      const r = parseRoutes(v, 4, where);
      expect(r.experts.length).toBe(4 * 2 * 2);
      expect(Array.from(r.experts.subarray(12))).toEqual([-1, -1, -1, -1]);
      expect(r.experts.subarray(0, 12)).toEqual(Int16Array.from(R.flat(2)));
    }
  });

  it('refuses each bad input naming record and field', () => {
    const cases: [unknown, number, string, RegExp][] = [
      [R, 5, 'routes', /routes for 5 tokens \(or 4/],
      [R, 2, 'routes', /routes for 2 tokens/],
      [compact(R, 'int16'), 5, 'routes.shape[0]', /routes for 5 tokens/],
      ['abc', 3, 'routes', /expected \{"dtype"/],
      [[], 1, 'routes', /empty array/],
      [{ ...compact(R, 'int16'), dtype: 'float32' }, 3, 'routes.dtype', /"uint8", "int16" or "int32"/],
      [{ ...compact(R, 'int16'), shape: [3, 4] }, 3, 'routes.shape', /\[T, layers, k\]/],
      [{ ...compact(R, 'int16'), shape: [3, 0, 2] }, 3, 'routes.shape[1]', /positive integer/],
      [{ ...compact(R, 'int16'), shape: [3, 2, 3] }, 3, 'routes.data', /needs 36 bytes, the base64 holds 24/],
      [{ ...compact(R, 'int16'), data: 'AAE*' }, 3, 'routes.data', /standard base64/],
      [{ ...compact(R, 'int16'), data: 'AAE' }, 3, 'routes.data', /standard base64/],
      [compact([[[1, -2]]], 'int32'), 1, 'routes[0][0][1]', /expert id .* got -2/],
      [compact([[[1, 40000]]], 'int32'), 1, 'routes[0][0][1]', /0\.\.32767\), got 40000/],
      [compact([[[1, 2]], [[5, 5]]], 'int16'), 2, 'routes[1][0]', /expert 5 is routed twice/],
      [[[[1, 2]], [[5, 5]]], 2, 'routes[1][0]', /expert 5 is routed twice/],
      [[[[1, 2]], [[5, 1.5]]], 2, 'routes[1][0][1]', /got 1\.5/],
      [[[[1, 2]], [[5, '3']]], 2, 'routes[1][0][1]', /expected an expert id/],
      [[[[1, 2]], [[5, -1]]], 2, 'routes[1][0][1]', /got -1/],
      [[[[1, 2]], [[5]]], 2, 'routes[1][0]', /array of 2 expert ids/],
      [
        [
          [[1, 2]],
          [
            [5, 6],
            [7, 8],
          ],
        ],
        2,
        'routes[1]',
        /array of 1 layers/,
      ],
      [[[[1, 2]], 7], 2, 'routes[1]', /array of 1 layers/],
      [[[]], 1, 'routes[0]', /non-empty array of layers/],
    ];
    for (const [value, tokens, field, message] of cases) {
      const e = rejected(value, tokens);
      expect(e.code).toBe('E_INPUT');
      expect(e.where).toEqual({ ...where, field });
      expect(e.message).toMatch(message);
      expect(e.message).toContain('record "rec-1"');
    }
  });

  it('names the field path a caller gives (a chat response)', () => {
    try {
      parseRoutes([[[1, 1]]], 1, where, 'response.routes');
      throw new Error('expected a rejection');
    } catch (e) {
      expect((e as TreepackError).where.field).toBe('response.routes[0][0]');
    }
  });
});

describe('pre-tokenized samples with routes', () => {
  it('carry them; a bad one names file, line, record and field', () => {
    const [s] = parseRecords({ id: 'a', tokens: [5, 6, 7, 8], routes: R }, { file: 'in.jsonl', line: 2 }) as Sample[];
    expect(s.routes?.experts.length).toBe(16);
    expect(s.routes?.experts[15]).toBe(-1);
    expect(() => parseRecords({ id: 'b', tokens: [5, 6], routes: R }, { file: 'in.jsonl', line: 9 })).toThrow(
      /in\.jsonl:9, record "b", field "routes": expected routes for 2 tokens/,
    );
    const [plain] = parseRecords({ id: 'c', tokens: [5, 6], routes: null }, { file: 'in.jsonl', line: 1 }) as Sample[];
    expect(plain.routes).toBeUndefined();
  });
});

describe("slime samples' rollout_routed_experts", () => {
  it('are their routes: numpy [T - 1, layers, k] as JSON lists, the last token unrouted; a bad one names the field', () => {
    // a slime Sample as JSON: response-only arrays, routes over the prompt and the response but the last token
    const slime = { index: 7, group_index: 2, tokens: [5, 6, 7, 8], response_length: 2, reward: 1, rollout_routed_experts: R };
    const [s] = parseRecords(slime, { file: 'slime.jsonl', line: 4 }) as Sample[];
    expect([s.routes?.layers, s.routes?.topK]).toEqual([2, 2]);
    expect([...s.routes!.experts]).toEqual([...R.flat(2), -1, -1, -1, -1]);
    // the compact form too, as a caller that keeps the numpy bytes would send them
    const [c] = parseRecords({ ...slime, rollout_routed_experts: compact(R, 'int32') }, { file: 'slime.jsonl', line: 5 }) as Sample[];
    expect(c.routes?.experts).toEqual(s.routes?.experts);
    expect(() => parseRecords({ ...slime, tokens: [5, 6] }, { file: 'slime.jsonl', line: 6 })).toThrow(
      /slime\.jsonl:6, record "7", field "rollout_routed_experts": expected routes for 2 tokens/,
    );
    expect(() =>
      parseRecords(
        {
          ...slime,
          rollout_routed_experts: [
            [
              [1, 1],
              [0, 2],
            ],
            ...R.slice(1),
          ],
        },
        { file: 'slime.jsonl', line: 7 },
      ),
    ).toThrow(/field "rollout_routed_experts\[0\]\[0\]/);
  });
});
