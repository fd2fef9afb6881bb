/**
 * The PyTorch trainer side's own costs (bench/torch_trainer.py): `packed_logprobs` at logit nodes vs full logits (on an
 * agent forest, about a quarter of the nodes scored, and a single-turn one, about three quarters), and block-sparse
 * tree attention vs SDPA with the dense tree mask, forward + backward. --full only: logprobs at 4k and attention at
 * 4k–32k (a few minutes on a 2-core CPU), each baseline bounded by the machine's memory (bench/torch_trainer.py
 * --max-gib); `python bench/torch_trainer.py --quick` takes the small points by hand.
 */
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { findPython, harnessAllocator, root } from './python.js';

export interface TrainerSection {
  skipped?: string;
  device?: string;
  torch?: string;
  /** the harness's CPU allocator settings (harnessAllocator) */
  allocator?: string;
  rows?: Record<string, unknown>[];
}

export async function benchTrainer(full: boolean): Promise<TrainerSection> {
  const title = '\n## trainer side: node logprobs vs full logits, block-sparse vs dense tree attention (forward + backward)';
  // Not in the default run: a third Python start and the small sizes' figures (a few hundred tokens) say little.
  if (!full) {
    console.log(`${title}: skipped (npm run bench -- --full, or python bench/torch_trainer.py --quick)`);
    return { skipped: 'not --full' };
  }
  console.log(title);
  const env = await findPython();
  if (!env.torch || !env.python) {
    console.log(`skipped: no Python with torch: ${env.reason}`);
    return { skipped: `no Python with torch: ${env.reason}` };
  }
  const dir = mkdtempSync(join(tmpdir(), 'treepack-bench-trainer-'));
  try {
    const json = join(dir, 'trainer.json');
    const allocator = harnessAllocator();
    console.log(`harness allocator: ${allocator.label}`);
    // The script prints its own table (ratios against the baseline of the same run) as each case ends.
    const r = spawnSync(env.python, [join(root, 'bench', 'torch_trainer.py'), '--json', json], {
      stdio: ['ignore', 'inherit', 'inherit'],
      env: { ...process.env, ...allocator.env },
    });
    if (r.status !== 0) return { skipped: `bench/torch_trainer.py exited with ${r.status ?? r.signal}` };
    return { ...(JSON.parse(readFileSync(json, 'utf8')) as TrainerSection), allocator: allocator.label };
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}
