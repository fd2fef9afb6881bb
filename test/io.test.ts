/**
 * safetensors and micro-batch files, atomic writes, and the forest invariant checker. Expected bytes and
 * corrupt files are built by hand here, never from the writer's output.
 */
import { afterAll, describe, expect, it } from 'vitest';
import { mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, truncateSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { TreepackError } from '../src/errors.js';
import { writeFileAtomic } from '../src/io/atomic.js';
import { readMicroBatch, writeMicroBatch } from '../src/io/microbatch.js';
import { parseSafetensors, readSafetensors, writeSafetensors, type Tensor } from '../src/io/safetensors.js';
import { FORMAT, OCCURRENCE_FLOAT_FIELDS, type Forest, type MicroBatch, type Sequences } from '../src/pack/contract.js';
import { packForest } from '../src/pack/forest.js';
import { checkForest } from '../src/pack/invariants.js';
import { caught } from './helpers/errors.js';
import { csr, randomBatch, randomMicroBatch, rng } from './helpers/sequences.js';

const dir = mkdtempSync(join(tmpdir(), 'treepack-io-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
let fileCounter = 0;
const tmpFile = (name = 'f') => join(dir, `${name}-${fileCounter++}.safetensors`);

/** A safetensors file from a header given as JSON text (or object) and raw data, with an optional length lie. */
function handBuilt(header: string | object, data: Uint8Array, lengthField?: bigint): Uint8Array {
  const json = Buffer.from(typeof header === 'string' ? header : JSON.stringify(header), 'utf8');
  const out = new Uint8Array(8 + json.length + data.length);
  new DataView(out.buffer).setBigUint64(0, lengthField ?? BigInt(json.length), true);
  out.set(json, 8);
  out.set(data, 8 + json.length);
  return out;
}

/** A safetensors header as the tests corrupt it: tensor entries by name, and __metadata__ (whose values the tests replace). */
type Header = Record<string, { data_offsets: number[]; [key: string]: unknown }>;

/** Splits a file into its parsed header and data, for corrupting one part and rebuilding. */
function splitFile(bytes: Uint8Array): { header: Header; data: Uint8Array } {
  const n = Number(new DataView(bytes.buffer, bytes.byteOffset).getBigUint64(0, true));
  return { header: JSON.parse(Buffer.from(bytes.subarray(8, 8 + n)).toString('utf8')) as Header, data: bytes.slice(8 + n) };
}

function expectInputError(fn: () => unknown, file: string | undefined, field: string, message?: RegExp): void {
  const e = caught(fn) as TreepackError;
  expect(e).toBeInstanceOf(TreepackError);
  expect(e.code).toBe('E_INPUT');
  expect(e.where.file).toBe(file);
  expect(e.where.field).toBe(field);
  if (message) expect(e.message).toMatch(message);
}

function expectSameBatch(got: MicroBatch, want: MicroBatch): void {
  for (const f of ['input_ids', 'position_ids', 'parent', 'subtree_end', 'seq_offsets', 'seq_positions', 'loss_mask'] as const) {
    expect(got[f], f).toEqual(want[f]);
  }
  for (const f of OCCURRENCE_FLOAT_FIELDS) expect(got[f], f).toEqual(want[f]);
  expect(got.meta).toEqual(want.meta);
}

describe('safetensors layout', () => {
  it('writes the hand-computed bytes of a tiny file', () => {
    const path = tmpFile();
    writeSafetensors(
      path,
      new Map<string, Tensor>([
        ['b', { dtype: 'I32', shape: [2], data: new Int32Array([1, -2]) }],
        ['a', { dtype: 'U8', shape: [3], data: new Uint8Array([7, 8, 9]) }],
        ['10', { dtype: 'F32', shape: [1], data: new Float32Array([1.5]) }],
      ]),
      { k: 'v' },
    );
    // Header keys by name ("10" stays first: no integer-key reordering); data by element size, then name.
    const json =
      '{"__metadata__":{"k":"v"},' +
      '"10":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},' +
      '"a":{"dtype":"U8","shape":[3],"data_offsets":[12,15]},' +
      '"b":{"dtype":"I32","shape":[2],"data_offsets":[4,12]}}';
    expect(json.length).toBe(188);
    const expected = Buffer.concat([
      Buffer.from([192, 0, 0, 0, 0, 0, 0, 0]), // 188 bytes of JSON + 4 spaces
      Buffer.from(json + '    ', 'ascii'),
      Buffer.from([0x00, 0x00, 0xc0, 0x3f]), // 1.5f
      Buffer.from([0x01, 0x00, 0x00, 0x00, 0xfe, 0xff, 0xff, 0xff]), // 1, -2
      Buffer.from([7, 8, 9]),
    ]);
    expect(readFileSync(path).equals(expected)).toBe(true);
    const back = readSafetensors(path);
    expect(back.metadata).toEqual({ k: 'v' });
    expect(back.tensors.get('b')).toEqual({ dtype: 'I32', shape: [2], data: new Int32Array([1, -2]) });
    expect(back.tensors.get('10')!.data).toEqual(new Float32Array([1.5]));
  });

  it('writes the hand-computed bytes of a one-token micro-batch', () => {
    const path = tmpFile('mb');
    const batch: MicroBatch = {
      ...packForest(csr([[5]])),
      loss_mask: new Uint8Array([0]),
      meta: { format: FORMAT, num_sequences: 1, num_tokens_naive: 1, num_tokens_packed: 1, tokenizer: 't', sequence_ids: ['x'] },
    };
    writeMicroBatch(path, batch);
    const meta =
      '"__metadata__":{"format":"treepack/1","num_sequences":"1","num_tokens_naive":"1","num_tokens_packed":"1",' +
      '"sequence_ids":"[\\"x\\"]","tokenizer":"t"}';
    const json =
      '{' +
      meta +
      ',"input_ids":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}' +
      ',"loss_mask":{"dtype":"U8","shape":[1],"data_offsets":[28,29]}' +
      ',"parent":{"dtype":"I32","shape":[1],"data_offsets":[4,8]}' +
      ',"position_ids":{"dtype":"I32","shape":[1],"data_offsets":[8,12]}' +
      ',"seq_offsets":{"dtype":"I32","shape":[2],"data_offsets":[12,20]}' +
      ',"seq_positions":{"dtype":"I32","shape":[1],"data_offsets":[20,24]}' +
      ',"subtree_end":{"dtype":"I32","shape":[1],"data_offsets":[24,28]}}';
    expect(json.length).toBe(591);
    const expected = Buffer.concat([
      Buffer.from([0x50, 0x02, 0, 0, 0, 0, 0, 0]), // 592 = 591 + 1 space
      Buffer.from(json + ' ', 'ascii'),
      Buffer.from([5, 0, 0, 0]), // input_ids
      Buffer.from([0xff, 0xff, 0xff, 0xff]), // parent -1
      Buffer.from([0, 0, 0, 0]), // position_ids
      Buffer.from([0, 0, 0, 0, 1, 0, 0, 0]), // seq_offsets
      Buffer.from([0, 0, 0, 0]), // seq_positions
      Buffer.from([1, 0, 0, 0]), // subtree_end
      Buffer.from([0]), // loss_mask
    ]);
    expect(readFileSync(path).equals(expected)).toBe(true);
  });

  it('round-trips every dtype, scalars and empty tensors', () => {
    const path = tmpFile();
    const tensors = new Map<string, Tensor>([
      ['i64', { dtype: 'I64', shape: [2, 2], data: new BigInt64Array([1n, -2n, 3n, -(2n ** 62n)]) }],
      ['u64', { dtype: 'U64', shape: [1], data: new BigUint64Array([2n ** 64n - 1n]) }],
      ['f64', { dtype: 'F64', shape: [3], data: new Float64Array([Math.PI, -0, Infinity]) }],
      ['bf16', { dtype: 'BF16', shape: [2], data: new Uint16Array([0x3f80, 0xc000]) }],
      ['f16', { dtype: 'F16', shape: [1], data: new Uint16Array([0x3c00]) }],
      ['bool', { dtype: 'BOOL', shape: [3], data: new Uint8Array([1, 0, 1]) }],
      ['i8', { dtype: 'I8', shape: [1], data: new Int8Array([-5]) }],
      ['u32', { dtype: 'U32', shape: [], data: new Uint32Array([4e9]) }],
      ['empty', { dtype: 'F32', shape: [0, 4], data: new Float32Array(0) }],
    ]);
    writeSafetensors(path, tensors);
    const back = readSafetensors(path);
    expect(back.metadata).toEqual({});
    expect(new Map([...back.tensors].sort())).toEqual(new Map([...tensors].sort()));
  });

  it('returns zero-copy views when aligned and copies when not', () => {
    const { batch } = randomMicroBatch(5);
    const path = tmpFile();
    writeMicroBatch(path, batch);
    const { batch: got } = readMicroBatch(path);
    expect(got.input_ids.buffer).toBe(got.parent.buffer);
    expect(got.loss_mask.buffer).toBe(got.seq_positions.buffer);

    // An I32 at byte 1 of the data cannot be viewed in place.
    const header = { a: { dtype: 'U8', shape: [1], data_offsets: [0, 1] }, b: { dtype: 'I32', shape: [2], data_offsets: [1, 9] } };
    const file = handBuilt(header, new Uint8Array([9, 1, 0, 0, 0, 0xff, 0xff, 0xff, 0x7f]));
    const { tensors } = parseSafetensors(file);
    expect(tensors.get('b')!.data).toEqual(new Int32Array([1, 0x7fffffff]));
    expect(tensors.get('b')!.data.buffer).not.toBe(file.buffer);
    expect(tensors.get('a')!.data.buffer).toBe(file.buffer);
    // The same file shifted by one byte in memory: now b is aligned and a view, whatever the buffer offset.
    const shifted = new Uint8Array(file.length + 1);
    shifted.set(file, 1);
    const again = parseSafetensors(shifted.subarray(1));
    expect(again.tensors.get('b')!.data).toEqual(new Int32Array([1, 0x7fffffff]));
    expect(again.tensors.get('b')!.data.buffer).toBe(shifted.buffer);
  });

  it('rejects bad arguments to the writer', () => {
    const path = tmpFile();
    const write =
      (t: Tensor, name = 'x') =>
      () =>
        writeSafetensors(path, new Map([[name, t]]));
    expect(write({ dtype: 'I32', shape: [3], data: new Int32Array(2) })).toThrow(/shape/);
    expect(write({ dtype: 'F32', shape: [2], data: new Int32Array(2) })).toThrow(/Float32Array/);
    expect(write({ dtype: 'X' as never, shape: [2], data: new Int32Array(2) })).toThrow(/dtype/);
    expect(write({ dtype: 'U8', shape: [0], data: new Uint8Array(0) }, '__metadata__')).toThrow(/name/);
    expect(readdirSync(dir).filter((f) => f.includes('.tmp-'))).toEqual([]);
  });
});

describe('micro-batch files', () => {
  it('round-trip random micro-batches with extra tensors', () => {
    for (let seed = 0; seed < 60; seed++) {
      const { batch, seqs } = randomMicroBatch(seed);
      const extra = new Map<string, Tensor>([
        ['mask_kv_indices', { dtype: 'I32', shape: [2, 3], data: Int32Array.from([1, 2, 3, 4, 5, seed]) }],
        ['mask_dense', { dtype: 'BOOL', shape: [0], data: new Uint8Array(0) }],
      ]);
      const path = tmpFile('rt');
      writeMicroBatch(path, batch, seed % 2 ? extra : undefined);
      const got = readMicroBatch(path);
      expectSameBatch(got.batch, batch);
      for (const f of OCCURRENCE_FLOAT_FIELDS) if (!batch[f]) expect(f in got.batch).toBe(false);
      expect(got.extra).toEqual(seed % 2 ? extra : new Map());
      expect(checkForest(got.batch, seqs)).toEqual([]);
    }
  });

  it('refuses to write an inconsistent batch and leaves the old file', () => {
    const { batch } = randomMicroBatch(7);
    const path = tmpFile();
    writeMicroBatch(path, batch);
    const before = readFileSync(path);
    const cases: [Partial<MicroBatch>, string][] = [
      [{ meta: { ...batch.meta, num_tokens_packed: batch.meta.num_tokens_packed + 1 } }, 'num_tokens_packed'],
      [{ meta: { ...batch.meta, format: 'treepack/0' as never } }, 'format'],
      [{ meta: { ...batch.meta, sequence_ids: batch.meta.sequence_ids.slice(1) } }, 'sequence_ids'],
      [{ loss_mask: new Uint8Array(batch.loss_mask.length + 1) }, 'loss_mask'],
      [{ parent: batch.parent.subarray(1) }, 'parent'],
      [{ advantages: new Float32Array(1 + batch.seq_positions.length) }, 'advantages'],
    ];
    for (const [change, field] of cases) {
      const err = caught(() => writeMicroBatch(path, { ...batch, ...change })) as TreepackError;
      expect(err, field).toBeInstanceOf(TreepackError);
      expect(err.code).toBe('E_ARG');
      expect(err.where.field).toBe(field);
    }
    expect(() => writeMicroBatch(path, { ...batch, input_ids: Array.from(batch.input_ids) as never })).toThrow(/batch\.input_ids/);
    expect(() => writeMicroBatch(path, batch, new Map([['parent', { dtype: 'U8', shape: [0], data: new Uint8Array(0) }]]))).toThrow(
      /contract/,
    );
    expect(readFileSync(path).equals(before)).toBe(true);
  });

  describe('corrupt files', () => {
    const { batch } = randomMicroBatch(12);
    const good = tmpFile('good');
    writeMicroBatch(good, batch);
    const bytes = new Uint8Array(readFileSync(good));
    const N = batch.input_ids.length;
    const M = batch.seq_positions.length;

    /** Writes a corrupted copy of the good file and returns its path. */
    function corrupt(mutate: (header: Header, data: Uint8Array) => void): string {
      const { header, data } = splitFile(bytes);
      mutate(header, data);
      const path = tmpFile('bad');
      writeFileSync(path, handBuilt(header, data));
      return path;
    }
    const setI32 = (data: Uint8Array, byte: number, v: number) => new DataView(data.buffer, data.byteOffset).setInt32(byte, v, true);

    it('truncated file', () => {
      const path = tmpFile('bad');
      writeFileSync(path, bytes.subarray(0, bytes.length - 3));
      // Data is laid out 4-byte tensors first, so the 1-byte loss_mask is last and is the one cut off.
      expectInputError(() => readMicroBatch(path), path, 'loss_mask', /past the end of the data.*truncated/);
      writeFileSync(path, bytes.subarray(0, 5));
      expectInputError(() => readMicroBatch(path), path, '__header__', /shorter than the 8-byte header length/);
    });

    it('header length past EOF', () => {
      const path = tmpFile('bad');
      const { header, data } = splitFile(bytes);
      writeFileSync(path, handBuilt(header, data, BigInt(bytes.length)));
      expectInputError(() => readMicroBatch(path), path, '__header__', /runs past the end of the file/);
      writeFileSync(path, handBuilt(header, data, 2n ** 64n - 1n));
      expectInputError(() => readMicroBatch(path), path, '__header__', /runs past the end of the file/);
    });

    it('bad JSON, non-object header, bad UTF-8', () => {
      const path = tmpFile('bad');
      writeFileSync(path, handBuilt('{"input_ids":', new Uint8Array(0)));
      expectInputError(() => readMicroBatch(path), path, '__header__', /not valid UTF-8 JSON/);
      writeFileSync(path, handBuilt('[1, 2]', new Uint8Array(0)));
      expectInputError(() => readMicroBatch(path), path, '__header__', /not a JSON object/);
      const invalidUtf8 = handBuilt('{"a":1}', new Uint8Array(0));
      invalidUtf8[9] = 0xff;
      writeFileSync(path, invalidUtf8);
      expectInputError(() => readMicroBatch(path), path, '__header__', /not valid UTF-8 JSON/);
    });

    it('unknown dtype', () => {
      const path = corrupt((h) => (h.input_ids.dtype = 'I33'));
      expectInputError(() => readMicroBatch(path), path, 'input_ids', /unknown dtype "I33"/);
    });

    it('shape and byte length disagree', () => {
      const path = corrupt((h) => (h.parent.shape = [N + 1]));
      expectInputError(() => readMicroBatch(path), path, 'parent', /needs \d+ bytes but data_offsets span/);
      const neg = corrupt((h) => (h.parent.shape = [-1]));
      expectInputError(() => readMicroBatch(neg), neg, 'parent', /not a list of non-negative integers/);
      const offs = corrupt((h) => (h.parent.data_offsets = [8, 4]));
      expectInputError(() => readMicroBatch(offs), offs, 'parent', /begin <= end/);
    });

    it('overlapping offsets', () => {
      const path = corrupt((h) => {
        const [b, e] = h.parent.data_offsets;
        h.position_ids.data_offsets = [b + 4, e + 4];
      });
      expectInputError(() => readMicroBatch(path), path, 'position_ids', /overlap tensor "parent"/);
    });

    it('missing tensor', () => {
      const path = corrupt((h) => delete h.subtree_end);
      expectInputError(() => readMicroBatch(path), path, 'subtree_end', /required tensor subtree_end is missing/);
    });

    it('wrong dtype', () => {
      const path = corrupt((h) => (h.loss_mask.dtype = 'I8'));
      expectInputError(() => readMicroBatch(path), path, 'loss_mask', /dtype I8, expected U8/);
      const twoD = corrupt((h) => (h.seq_positions.shape = [1, M]));
      expectInputError(() => readMicroBatch(twoD), twoD, 'seq_positions', /expected 1-D/);
    });

    it('format mismatch or missing metadata', () => {
      const path = corrupt((h) => (h.__metadata__.format = 'treepack/2'));
      expectInputError(() => readMicroBatch(path), path, 'format', /"treepack\/2", expected "treepack\/1"/);
      const none = corrupt((h) => delete h.__metadata__);
      expectInputError(() => readMicroBatch(none), none, 'format', /missing/);
    });

    it('metadata inconsistent with the tensors', () => {
      const packed = corrupt((h) => (h.__metadata__.num_tokens_packed = String(N + 1)));
      expectInputError(() => readMicroBatch(packed), packed, 'num_tokens_packed', /but the tensors say/);
      const notNum = corrupt((h) => (h.__metadata__.num_sequences = '1e3'));
      expectInputError(() => readMicroBatch(notNum), notNum, 'num_sequences', /non-negative integer/);
      const notStr = corrupt((h) => (h.__metadata__.tokenizer = 3));
      expectInputError(() => readMicroBatch(notStr), notStr, 'tokenizer', /not a string/);
      const ids = corrupt((h) => (h.__metadata__.sequence_ids = '["a",'));
      expectInputError(() => readMicroBatch(ids), ids, 'sequence_ids', /not JSON/);
    });

    it('seq_offsets[S] != M', () => {
      const S = batch.meta.num_sequences;
      const path = corrupt((h, data) => setI32(data, h.seq_offsets.data_offsets[0] + 4 * S, M - 1));
      expectInputError(
        () => readMicroBatch(path),
        path,
        'seq_offsets',
        new RegExp(`seq_offsets\\[S\\] = ${M - 1} but seq_positions has M = ${M}`),
      );
    });

    it('missing file is E_IO', () => {
      const path = join(dir, 'nope.safetensors');
      expect(() => readMicroBatch(path)).toThrow(expect.objectContaining({ code: 'E_IO', where: { file: path } }));
    });
  });
});

describe('writeFileAtomic', () => {
  const temps = () => readdirSync(dir).filter((f) => f.includes('.tmp-'));
  const BIG = 17 << 20; // above the flush threshold: these bytes reach the temp file before the failure

  it('replaces the file and leaves no temp file', () => {
    const path = join(dir, 'atomic.txt');
    writeFileAtomic(path, 'old');
    writeFileAtomic(path, [new Uint8Array([110, 101]), new Uint16Array([0x7777])]);
    expect(readFileSync(path, 'latin1')).toBe('ne\x77\x77');
    expect(temps()).toEqual([]);
  });

  it('keeps the old file when the producer throws mid-write', () => {
    const path = join(dir, 'atomic-throw.txt');
    writeFileAtomic(path, 'old content');
    const failure = new Error('producer failed');
    function* chunks(): Generator<Uint8Array> {
      yield new Uint8Array(BIG).fill(1);
      throw failure;
    }
    expect(() => writeFileAtomic(path, chunks())).toThrow(failure);
    expect(readFileSync(path, 'utf8')).toBe('old content');
    expect(temps()).toEqual([]);
  });

  it('keeps the old file when a chunk is not a typed array', () => {
    const path = join(dir, 'atomic-invalid.txt');
    writeFileAtomic(path, 'old content');
    // @ts-expect-error a string chunk, which the type forbids: the runtime check must refuse it as well
    expect(() => writeFileAtomic(path, [new Uint8Array(BIG), 'text'])).toThrow(expect.objectContaining({ code: 'E_ARG' }));
    expect(readFileSync(path, 'utf8')).toBe('old content');
    expect(temps()).toEqual([]);
  });

  it('keeps the target when the rename fails', () => {
    const target = join(dir, 'atomic-dir');
    mkdirSync(target);
    writeFileSync(join(target, 'inside'), 'x');
    expect(() => writeFileAtomic(target, 'data')).toThrow(expect.objectContaining({ code: 'E_IO', where: { file: target } }));
    expect(readFileSync(join(target, 'inside'), 'utf8')).toBe('x');
    expect(temps()).toEqual([]);
  });

  it('reports a missing directory as E_IO', () => {
    const path = join(dir, 'no-such-dir', 'f');
    expect(() => writeFileAtomic(path, 'data')).toThrow(expect.objectContaining({ code: 'E_IO', where: { file: path } }));
  });

  it('a truncated final file can only come from outside: the reader catches it', () => {
    const { batch } = randomMicroBatch(3);
    const path = tmpFile();
    writeMicroBatch(path, batch);
    truncateSync(path, 100);
    expect(() => readMicroBatch(path)).toThrow(TreepackError);
  });
});

describe('checkForest', () => {
  function clone(f: Forest): Forest {
    return {
      input_ids: f.input_ids.slice(),
      position_ids: f.position_ids.slice(),
      parent: f.parent.slice(),
      subtree_end: f.subtree_end.slice(),
      seq_offsets: f.seq_offsets.slice(),
      seq_positions: f.seq_positions.slice(),
    };
  }
  // Nodes: 0:1 (root) 1:2 2:3 3:4 4:5 5:6 (root); sequences occupy [0,1,2], [0,1,3], [0,4], [5].
  const seqs = csr([[1, 2, 3], [1, 2, 4], [1, 5], [6]]);
  const base = packForest(seqs);

  it('the fixture is what the comments say', () => {
    expect(Array.from(base.parent)).toEqual([-1, 0, 1, 1, 0, -1]);
    expect(Array.from(base.subtree_end)).toEqual([5, 4, 3, 4, 5, 6]);
    expect(Array.from(base.seq_positions)).toEqual([0, 1, 2, 0, 1, 3, 0, 4, 5]);
    expect(checkForest(base, seqs)).toEqual([]);
  });

  const cases: [string, (f: Forest) => void, RegExp][] = [
    ['parent not before the node', (f) => (f.parent[2] = 2), /^parent\[2\] = 2: expected -1 \(a root\) or a position before 2$/],
    ['parent below -1', (f) => (f.parent[0] = -2), /^parent\[0\] = -2/],
    ['position_ids not the depth', (f) => (f.position_ids[3] = 5), /^position_ids\[3\] = 5: expected 2/],
    ['subtree_end wrong', (f) => (f.subtree_end[1] = 3), /^subtree_end\[1\] = 3: expected 4 from parent$/],
    [
      'seq_positions out of range',
      (f) => (f.seq_positions[8] = 6),
      /^seq_positions\[8\] = 6: not a position in \[0, 6\) \(sequence 3, t = 0\)$/,
    ],
    [
      'parent chain broken',
      (f) => (f.seq_positions[2] = 4),
      /^parent\[seq_positions\[2\]\] = parent\[4\] = 0: expected seq_positions\[1\] = 1/,
    ],
    ['seq_offsets[S] != M', (f) => (f.seq_offsets[4] = 8), /^seq_offsets\[4\] = 8: expected M = 9/],
    ['seq_offsets decreasing', (f) => (f.seq_offsets[2] = 2), /^seq_offsets\[2\] = 2: less than seq_offsets\[1\] = 3/],
    ['node arrays of different lengths', (f) => (f.parent = f.parent.subarray(0, 5)), /^parent has 5 elements: expected N = 6/],
  ];
  for (const [name, breakIt, message] of cases) {
    it(`catches: ${name}`, () => {
      const f = clone(base);
      breakIt(f);
      const v = checkForest(f);
      expect(v.length).toBeGreaterThan(0);
      expect(
        v.some((m) => message.test(m)),
        v.join('\n'),
      ).toBe(true);
    });
  }

  it('catches a token mismatch only when given the sequences', () => {
    const f = clone(base);
    f.seq_positions[5] = 2; // sequence 1 now reads 1 2 3: a valid path, the wrong tokens
    expect(checkForest(f)).toEqual([]);
    expect(checkForest(f, seqs)).toEqual(['input_ids[seq_positions[5]] = input_ids[2] = 3: expected token 4 (sequence 1, t = 2)']);
    expect(
      checkForest(
        base,
        csr([
          [1, 2, 3],
          [1, 2, 4],
          [1, 5, 7],
        ]),
      ),
    ).toContain('seq_offsets differ from the offsets of the given sequences');
  });

  it('catches a layout that is not a DFS preorder even with subtree_end recomputed from parent', () => {
    // Sequences [1, 2] and [3] with the root 3 placed between 1 and its child 2.
    const f: Forest = {
      input_ids: Int32Array.from([1, 3, 2]),
      position_ids: Int32Array.from([0, 0, 1]),
      parent: Int32Array.from([-1, -1, 0]),
      subtree_end: Int32Array.from([3, 2, 3]),
      seq_offsets: Int32Array.from([0, 2, 3]),
      seq_positions: Int32Array.from([0, 2, 1]),
    };
    expect(checkForest(f, csr([[1, 2], [3]]))).toEqual([
      'subtree of 0 is not contiguous: positions 0..2 hold only 2 of its nodes (layout is not a DFS preorder)',
    ]);
  });

  it('checks loss_mask at t = 0 and occurrence field lengths on a MicroBatch', () => {
    const { batch } = randomMicroBatch(21);
    expect(checkForest(batch)).toEqual([]);
    const off = batch.seq_offsets.findIndex((o, i) => i < batch.meta.num_sequences && batch.seq_offsets[i + 1] > o);
    const k = batch.seq_offsets[off];
    const bad = { ...batch, loss_mask: batch.loss_mask.slice() };
    bad.loss_mask[k] = 1;
    expect(checkForest(bad)).toEqual([`loss_mask[${k}] = 1: expected 0 at t = 0 (sequence ${off}, t = 0)`]);
    const M = batch.seq_positions.length;
    expect(checkForest({ ...batch, old_logprobs: new Float32Array(M + 1) })).toEqual([
      `old_logprobs has ${M + 1} elements: expected M = ${M} (length of seq_positions)`,
    ]);
  });

  it('caps the report', () => {
    const f = clone(packForest(csr([Array.from({ length: 500 }, (_, i) => i)])));
    f.position_ids.fill(0);
    const v = checkForest(f);
    expect(v.length).toBe(101);
    expect(v[100]).toMatch(/^… and \d+ more violations$/);
  });

  /** Brute force over all pairs: the definition of a valid forest, sharing no logic with checkForest. */
  function bruteValid(f: Forest, s: Sequences): boolean {
    const N = f.input_ids.length;
    if (f.parent.length !== N || f.position_ids.length !== N || f.subtree_end.length !== N) return false;
    for (let p = 0; p < N; p++) if (!(f.parent[p] >= -1 && f.parent[p] < p)) return false;
    const isAncestorOrSelf = (k: number, q: number) => {
      for (let x = q; x >= 0; x = f.parent[x]) if (x === k) return true;
      return false;
    };
    for (let p = 0; p < N; p++) {
      let depth = 0;
      for (let x = f.parent[p]; x >= 0; x = f.parent[x]) depth++;
      if (f.position_ids[p] !== depth) return false;
    }
    // The mask rule only looks at q < N; the contract bounds subtree_end too.
    if (f.subtree_end.some((e) => e > N)) return false;
    for (let k = 0; k < N; k++) for (let q = 0; q < N; q++) if ((k <= q && q < f.subtree_end[k]) !== isAncestorOrSelf(k, q)) return false;
    if (f.seq_offsets.length !== s.offsets.length || f.seq_offsets.some((o, i) => o !== s.offsets[i])) return false;
    if (f.seq_positions.length !== s.tokens.length) return false;
    for (let i = 0; i + 1 < s.offsets.length; i++) {
      for (let t = 0; t < s.offsets[i + 1] - s.offsets[i]; t++) {
        const k = s.offsets[i] + t;
        const p = f.seq_positions[k];
        if (!(p >= 0 && p < N)) return false;
        if (f.input_ids[p] !== s.tokens[k] || f.position_ids[p] !== t) return false;
        if (f.parent[p] !== (t === 0 ? -1 : f.seq_positions[k - 1])) return false;
      }
    }
    return true;
  }

  it('agrees with brute force on randomly mutated forests', () => {
    let invalid = 0;
    for (let seed = 0; seed < 1500; seed++) {
      const r = rng(seed + 1000);
      const arrays = randomBatch(seed, { count: 1 + (seed % 6), maxLen: 6, alphabet: 3 });
      const s = csr(arrays);
      const f = clone(packForest(s));
      const N = f.input_ids.length;
      const fields = ['parent', 'position_ids', 'subtree_end', 'seq_positions', 'input_ids'] as const;
      for (let m = 1 + (seed % 2); m > 0; m--) {
        const a = f[fields[Math.floor(r() * fields.length)]];
        if (a.length) a[Math.floor(r() * a.length)] = Math.floor(r() * (N + 4)) - 2;
      }
      const valid = bruteValid(f, s);
      if (!valid) invalid++;
      expect(checkForest(f, s).length === 0, `seed ${seed}`).toBe(valid);
    }
    expect(invalid).toBeGreaterThan(500);
  });

  it('agrees with brute force on random topological layouts (preorder or not)', () => {
    let nonPreorder = 0;
    for (let seed = 0; seed < 800; seed++) {
      const r = rng(seed + 5000);
      const s = csr(randomBatch(seed, { count: 2 + (seed % 5), maxLen: 5, alphabet: 3 }));
      const f0 = packForest(s);
      const N = f0.input_ids.length;
      // Relabel nodes in a random order that keeps parents first, then derive everything from parent the naive
      // way: only the preorder property can fail.
      const placed = new Int32Array(N).fill(-1);
      const ready: number[] = [];
      for (let p = 0; p < N; p++) if (f0.parent[p] < 0) ready.push(p);
      const children: number[][] = Array.from({ length: N }, () => []);
      for (let p = 0; p < N; p++) if (f0.parent[p] >= 0) children[f0.parent[p]].push(p);
      for (let next = 0; ready.length; next++) {
        const p = ready.splice(Math.floor(r() * ready.length), 1)[0];
        placed[p] = next;
        ready.push(...children[p]);
      }
      const f: Forest = {
        input_ids: new Int32Array(N),
        position_ids: new Int32Array(N),
        parent: new Int32Array(N),
        subtree_end: new Int32Array(N),
        seq_offsets: f0.seq_offsets,
        seq_positions: f0.seq_positions.map((p) => placed[p]),
      };
      for (let p = 0; p < N; p++) {
        const np = placed[p];
        f.input_ids[np] = f0.input_ids[p];
        f.position_ids[np] = f0.position_ids[p];
        f.parent[np] = f0.parent[p] < 0 ? -1 : placed[f0.parent[p]];
        f.subtree_end[np] = np + 1;
      }
      for (let p = N - 1; p >= 0; p--)
        if (f.parent[p] >= 0) f.subtree_end[f.parent[p]] = Math.max(f.subtree_end[f.parent[p]], f.subtree_end[p]);
      const valid = bruteValid(f, s);
      if (!valid) nonPreorder++;
      expect(checkForest(f, s).length === 0, `seed ${seed}`).toBe(valid);
    }
    expect(nonPreorder).toBeGreaterThan(100);
  });
});
