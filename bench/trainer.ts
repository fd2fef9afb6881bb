/**
 * The PyTorch trainer side's own costs (bench/torch_trainer.py): `packed_logprobs` at logit nodes vs full logits,
 * and block-sparse tree attention vs SDPA with the dense tree mask at N = 4k–32k, forward + backward. Every case
 * takes minutes on a 2-core CPU, so it runs with --full only; the default run says so.
 */
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { findPython, root } from './python.js';

export interface TrainerSection {
  skipped?: string;
  device?: string;
  torch?: string;
  rows?: Record<string, unknown>[];
}

export async function benchTrainer(full: boolean): Promise<TrainerSection> {
  console.log('\n## trainer side: node logprobs vs full logits, block-sparse vs dense tree attention (forward + backward)');
  if (!full) {
    const skipped = 'runs with --full (minutes per case on CPU): python bench/torch_trainer.py [--quick] --json FILE';
    console.log(`skipped: ${skipped}`);
    return { skipped };
  }
  const env = await findPython();
  if (!env.torch || !env.python) {
    console.log(`skipped: no Python with torch: ${env.reason}`);
    return { skipped: `no Python with torch: ${env.reason}` };
  }
  const dir = mkdtempSync(join(tmpdir(), 'treepack-bench-trainer-'));
  try {
    const json = join(dir, 'trainer.json');
    // The script prints its own table (ratios against the baseline of the same run) as each case ends.
    const r = spawnSync(env.python, [join(root, 'bench', 'torch_trainer.py'), '--json', json], { stdio: ['ignore', 'inherit', 'inherit'] });
    if (r.status !== 0) return { skipped: `bench/torch_trainer.py exited with ${r.status ?? r.signal}` };
    return JSON.parse(readFileSync(json, 'utf8')) as TrainerSection;
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}
