/**
 * python/treepack/flex.py on micro-batches with masks written by the TypeScript side: the stored block arrays equal
 * what torch's create_block_mask derives from the dense rule (numpy reference), and the slices cover exactly the
 * visible pairs. The FlexAttention-vs-SDPA test (torch + CUDA) reports its skip here and runs on the GPU host.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { delimiter, join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { writeMicroBatch } from '../src/io/microbatch.js';
import { maskTensors } from '../src/io/masks.js';
import { FORMAT, type MicroBatch } from '../src/pack/contract.js';
import { packForest } from '../src/pack/forest.js';
import { pythonFor, pythonTests } from './helpers/python.js';
import { csr, randomBatch } from './helpers/sequences.js';

const py = pythonFor('test/python-masks.test.ts', 'numpy');
const skipReason = py.skipReason;

describe.skipIf(skipReason !== '')('python flex helpers on stored masks', () => {
  const dir = mkdtempSync(join(tmpdir(), 'treepack-py-masks-'));
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  it('block arrays and slices in the files agree with the dense rule in numpy', { timeout: 60_000 }, async () => {
    const files: string[] = [];
    for (let seed = 1; seed <= 8; seed++) {
      const seqs = csr(randomBatch(seed, { count: 40, maxLen: 30 }));
      const forest = packForest(seqs);
      const M = seqs.tokens.length,
        S = seqs.offsets.length - 1;
      const batch: MicroBatch = {
        ...forest,
        loss_mask: new Uint8Array(M),
        meta: {
          format: FORMAT,
          num_sequences: S,
          num_tokens_naive: M,
          num_tokens_packed: forest.input_ids.length,
          tokenizer: 't',
          sequence_ids: Array.from({ length: S }, (_, i) => String(i)),
        },
      };
      const { tensors, metadata } = await maskTensors(
        forest,
        [{ kind: 'blocks', blockSize: seed % 2 ? 16 : 64 }, { kind: 'slices' }],
        'js',
      );
      const path = join(dir, `mb-${seed}.safetensors`);
      writeMicroBatch(path, batch, tensors, metadata);
      files.push(path);
    }
    const res = py.run(['-m', 'unittest', 'discover', '-v', '-s', pythonTests, '-p', 'test_flex*.py'], {
      env: { TREEPACK_MASK_FILES: files.join(delimiter) },
    });
    expect(res.status, res.stderr).toBe(0);
    expect(res.stderr).toMatch(/test_every_file_agrees_with_the_dense_rule \(.*\) \.\.\. ok/);
    expect(res.stderr).toMatch(/test_python_builders_equal_the_stored_lowerings \(.*\) \.\.\. ok/);
    const gpu = res.stderr.match(/test_flex_attention_matches_sdpa \(.*\) \.\.\. (.*)/)?.[1];
    console.log(`python FlexAttention vs SDPA: ${gpu}`);
    expect(gpu).toBeDefined();
  });
});
