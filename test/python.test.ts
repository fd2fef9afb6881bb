/**
 * The Python reader (python/treepack, as installed from the wheel) on files written by the TypeScript writer, and
 * the Python unit tests, the doctests of python/treepack's docstrings among them. Skipped, with the reason printed,
 * where no Python with numpy is found or the wheel cannot be built (test/helpers/python.ts).
 */
import { afterAll, describe, expect, it } from 'vitest';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { writeMicroBatch } from '../src/io/microbatch.js';
import type { Tensor } from '../src/io/safetensors.js';
import { FORMAT, OCCURRENCE_FLOAT_FIELDS, type MicroBatch } from '../src/pack/contract.js';
import { packForest } from '../src/pack/forest.js';
import { checkForest } from '../src/pack/invariants.js';
import { pythonFor, pythonTests } from './helpers/python.js';
import { csr, randomBatch, rng, toArrays } from './helpers/sequences.js';

const py = pythonFor('test/python.test.ts', 'numpy');
const skipReason = py.skipReason;
const python = (args: string[]) => py.run(args);

function randomMicroBatch(seed: number): MicroBatch {
  const r = rng(seed + 77);
  const seqs = csr(seed === 0 ? [] : randomBatch(seed));
  const forest = packForest(seqs);
  const M = seqs.tokens.length;
  const loss_mask = Uint8Array.from({ length: M }, () => (r() < 0.5 ? 1 : 0));
  for (let i = 0; i + 1 < seqs.offsets.length; i++) if (seqs.offsets[i + 1] > seqs.offsets[i]) loss_mask[seqs.offsets[i]] = 0;
  const batch: MicroBatch = {
    ...forest,
    loss_mask,
    meta: {
      format: FORMAT,
      num_sequences: seqs.offsets.length - 1,
      num_tokens_naive: M,
      num_tokens_packed: forest.input_ids.length,
      tokenizer: 'tok',
      sequence_ids: Array.from({ length: seqs.offsets.length - 1 }, (_, i) => `seq-${seed}-${i}-ü`),
    },
  };
  for (const f of OCCURRENCE_FLOAT_FIELDS) if (r() < 0.5) batch[f] = Float32Array.from({ length: M }, () => r() * 4 - 2);
  return batch;
}

describe.skipIf(skipReason !== '')('python reader', () => {
  const dir = mkdtempSync(join(tmpdir(), 'treepack-py-'));
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  it("python unit tests and the docstrings' doctests pass", { timeout: 300_000 }, () => {
    // test_doctests.py runs every >>> example of python/treepack (torch's and TRL's too where they import).
    const res = py.run(['-m', 'unittest', 'discover', '-v', '-s', pythonTests], { timeout: 290_000, env: { OMP_NUM_THREADS: '1' } });
    expect(res.status, res.stderr.slice(-8000)).toBe(0);
    const skipped = res.stderr.match(/^.* \.\.\. skipped .*$/gm) ?? [];
    console.log(`python/tests: ${skipped.length} test(s) skipped here${skipped.length ? `: ${skipped.join('; ')}` : ''}`);
  });

  it('loads TypeScript-written micro-batches with identical arrays, sequences and metadata; pack_sequences lays them out alike', () => {
    const cases = [];
    for (let seed = 0; seed < 12; seed++) {
      const batch = randomMicroBatch(seed);
      const path = join(dir, `mb-${seed}.safetensors`);
      const extra = new Map<string, Tensor>([
        ['mask_blocks', { dtype: 'I64', shape: [2, 2], data: BigInt64Array.from([1n, 2n, 3n, BigInt(seed)]) }],
      ]);
      writeMicroBatch(path, batch, extra);
      const fields: Record<string, number[]> = {};
      for (const [k, v] of Object.entries(batch)) if (ArrayBuffer.isView(v)) fields[k] = Array.from(v as Int32Array);
      const seqs = toArrays({ tokens: Int32Array.from(batch.seq_positions, (p) => batch.input_ids[p]), offsets: batch.seq_offsets });
      cases.push({ path, fields, meta: batch.meta, seqs, extra: [1, 2, 3, seed] });
    }
    const expectedFile = join(dir, 'expected.json');
    writeFileSync(expectedFile, JSON.stringify(cases));
    const script = `
import json, sys
import numpy as np
import treepack
DT = {"input_ids": "int32", "position_ids": "int32", "parent": "int32", "subtree_end": "int32", "seq_offsets": "int32",
      "seq_positions": "int32", "loss_mask": "uint8"}
for case in json.load(open(sys.argv[1])):
    mb = treepack.load(case["path"])
    for name in ["input_ids", "position_ids", "parent", "subtree_end", "seq_offsets", "seq_positions", "loss_mask",
                 "advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs"]:
        want = case["fields"].get(name)
        got = getattr(mb, name)
        if want is None:
            assert got is None, name
            continue
        assert got.dtype == np.dtype(DT.get(name, "float32")), (name, got.dtype)
        assert np.array_equal(got, np.array(want, dtype=got.dtype)), name
    assert mb.meta == case["meta"], (mb.meta, case["meta"])
    for i, s in enumerate(case["seqs"]):
        assert mb.sequence(i).tolist() == s, i
    assert mb.extra["mask_blocks"].tolist() == [case["extra"][:2], case["extra"][2:]]
    assert treepack.check_invariants(mb) == [], treepack.check_invariants(mb)
    # pack_sequences (the C core through ctypes) lays the same sequences out byte for byte like packForest.
    packed = treepack.pack_sequences(case["seqs"])
    for name in ["input_ids", "position_ids", "parent", "subtree_end", "seq_offsets", "seq_positions"]:
        assert getattr(packed, name).tolist() == case["fields"][name], name
print("ok", len(json.load(open(sys.argv[1]))))
`;
    const res = python(['-c', script, expectedFile]);
    expect(res.stderr).toBe('');
    expect(res.stdout.trim()).toBe(`ok ${cases.length}`);
  });

  it('python -m treepack check agrees with checkForest on valid and broken files', () => {
    const files: string[] = [];
    const verdicts: boolean[] = [];
    for (let seed = 0; seed < 80; seed++) {
      const batch = randomMicroBatch(seed + 100);
      const r = rng(seed);
      const N = batch.input_ids.length;
      if (seed % 4 !== 0 && N > 0) {
        const fields = ['parent', 'position_ids', 'subtree_end', 'seq_positions'] as const;
        const a = batch[fields[seed % 4]];
        a[Math.floor(r() * a.length)] = Math.floor(r() * (N + 3)) - 2;
      }
      const path = join(dir, `cli-${seed}.safetensors`);
      writeMicroBatch(path, batch);
      files.push(path);
      verdicts.push(checkForest(batch).length === 0);
    }
    expect(verdicts.filter((v) => !v).length).toBeGreaterThan(20);
    const res = python(['-m', 'treepack', 'check', ...files]);
    expect(res.stderr).toBe('');
    expect(res.status).toBe(1);
    const ok = new Map<string, boolean>();
    for (const line of res.stdout.split('\n')) {
      const m = /^(\S+): (OK|\d+ violation)/.exec(line);
      if (m) ok.set(m[1], m[2] === 'OK');
    }
    expect(files.map((f) => ok.get(f))).toEqual(verdicts);

    const good = files.filter((_, i) => verdicts[i]);
    const allGood = python(['-m', 'treepack', 'check', ...good]);
    expect(allGood.status).toBe(0);
    expect(allGood.stdout.trim().split('\n')).toHaveLength(good.length);
  });

  it('reports a corrupt file by field and exits 1', () => {
    const path = join(dir, 'corrupt.safetensors');
    writeFileSync(path, Buffer.from([1, 0, 0, 0, 0, 0, 0, 0, 0x7b]));
    const res = python(['-m', 'treepack', 'check', path]);
    expect(res.status).toBe(1);
    expect(res.stdout).toMatch(
      /^.*corrupt\.safetensors: error \[E_INPUT\] \(field __header__\): not a valid safetensors file \(9 bytes\): .*invalid JSON in header/,
    );
  });
});
