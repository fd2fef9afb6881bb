/**
 * The PyTorch trainer side's own costs (bench/torch_trainer.py): `packed_logprobs` at logit nodes vs full logits (on an
 * agent forest, about a quarter of the nodes scored, and a single-turn one, about three quarters), and block-sparse
 * tree attention vs SDPA with the dense tree mask, forward + backward. The default run takes small points
 * (`--quick`: logprobs at N = 512, attention at 4k, seconds); --full runs logprobs at 4k and attention at 4k–32k
 * (a few minutes on a 2-core CPU), each baseline bounded by the machine's memory (bench/torch_trainer.py --max-gib).
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
  console.log(`\n## trainer side: node logprobs vs full logits, block-sparse vs dense tree attention (forward + backward)${full ? '' : '; small sizes (--full: attention 4k–32k, logprobs at 4k)'}`);
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
    const r = spawnSync(env.python, [join(root, 'bench', 'torch_trainer.py'), ...(full ? [] : ['--quick']), '--json', json], { stdio: ['ignore', 'inherit', 'inherit'], env: { ...process.env, ...allocator.env } });
    if (r.status !== 0) return { skipped: `bench/torch_trainer.py exited with ${r.status ?? r.signal}` };
    return { ...(JSON.parse(readFileSync(json, 'utf8')) as TrainerSection), allocator: allocator.label };
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}
