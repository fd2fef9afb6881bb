/**
 * The trainer side in PyTorch (python/treepack/torch): the Python suites in python/tests/trainer, run against the
 * installed wheel (test/helpers/python.ts) with the packages of the Python scripts/python-env.mjs finds or creates
 * (.venv with torch + transformers). They skip with the reason printed where none can be had, and fail instead
 * under TREEPACK_REQUIRE_TORCH=1 (CI).
 */
import { readdirSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import { pythonFor, pythonTests } from './helpers/python.js';

const py = pythonFor('test/python-torch.test.ts', 'torch');
const root = fileURLToPath(new URL('..', import.meta.url));

// The suites that spawn ranks (test_cp_*.py: context parallelism, shared pieces) run in a case each: together with
// the single-process suites, or with each other, they would come near one case's time limit on a busy host.
const trainerDir = join(pythonTests, 'trainer');
const suites = readdirSync(trainerDir)
  .filter((f) => /^test_.*\.py$/.test(f))
  .map((f) => f.slice(0, -3))
  .sort();
const cases: [string, string[]][] = [
  ['every single-process suite', suites.filter((m) => !m.startsWith('test_cp_'))],
  ...suites.filter((m) => m.startsWith('test_cp_')).map((m): [string, string[]] => [m, [m]]),
];

describe.skipIf(py.skipReason !== '')('treepack.torch (python/tests/trainer)', () => {
  it.each(cases)('%s passes, none skipped', { timeout: 600_000 }, (_, modules) => {
    expect(modules.length).toBeGreaterThan(0);
    // One thread: the models are tiny, and on a shared, busy host more threads only contend.
    const res = py.run(['-m', 'unittest', '-v', ...modules], { cwd: trainerDir, timeout: 590_000, env: { OMP_NUM_THREADS: '1' } });
    const log = res.stderr;
    expect(res.status, log.slice(-4000)).toBe(0);
    expect(log).toMatch(/\nOK\b/);
    // A suite that skips (core library or torch missing) must not pass silently here; only CUDA-only tests may skip.
    const skipped = log.match(/^.* \.\.\. skipped .*$/gm) ?? [];
    console.log(
      `treepack.torch: ${modules.length} modules, ${/Ran (\d+) tests?/.exec(log)?.[1]} tests, ${skipped.length} skipped here: ${skipped.join('; ')}`,
    );
    expect(skipped.filter((line) => !/CUDA/.test(line))).toEqual([]);
  });

  it('examples/grpo_step.py packs, loads and trains: packed and unpacked steps agree', { timeout: 600_000 }, () => {
    const res = py.run([join(root, 'examples', 'grpo_step.py'), '--json'], { cwd: root, timeout: 590_000, env: { OMP_NUM_THREADS: '1' } });
    expect(res.status, res.stderr.slice(-4000)).toBe(0);
    const out = JSON.parse(res.stdout.trim().split('\n').pop()!) as Record<string, number>;
    console.log(
      `examples/grpo_step.py: ${out.naive_tokens} naive → ${out.packed_tokens} packed tokens, loss ${out.loss_packed} vs ${out.loss_unpacked}, step ${out.step_seconds_packed.toFixed(2)} s vs ${out.step_seconds_unpacked.toFixed(2)} s`,
    );
    expect(out.packed_tokens).toBeLessThan(out.naive_tokens);
    expect(Math.abs(out.loss_packed - out.loss_unpacked)).toBeLessThan(1e-5 * Math.max(1, Math.abs(out.loss_unpacked)));
    expect(out.max_weight_difference_after_step).toBeLessThan(1e-5);
  });

  it('examples/context_parallel.py under torchrun (2 gloo ranks): the split step equals the one-rank step', { timeout: 600_000 }, () => {
    const args = ['-m', 'torch.distributed.run', '--standalone', '--nproc-per-node', '2', join(root, 'examples', 'context_parallel.py')];
    const res = py.run(args, { cwd: root, timeout: 590_000, env: { OMP_NUM_THREADS: '1' } });
    expect(res.status, res.stderr.slice(-4000)).toBe(0);
    const out = JSON.parse(res.stdout.trim().split('\n').pop()!) as Record<string, number | number[]>;
    console.log(`examples/context_parallel.py: ${JSON.stringify(out)}`);
    expect(out.ranks).toBe(2);
    expect((out.rank_context_tokens as number[])[1]).toBeGreaterThan(0); // rank 1 read keys/values of rank 0's nodes
    for (const key of ['max_diff_logprobs', 'max_diff_loss', 'max_diff_gradients', 'max_diff_weights_after_step']) {
      expect(out[key], key).toBeLessThan(1e-10);
    }
  });

  it(
    'examples/moe_router_replay.py: packed with replay equals unpacked with the same routes; without replay it differs',
    { timeout: 600_000 },
    () => {
      const res = py.run([join(root, 'examples', 'moe_router_replay.py')], { cwd: root, timeout: 590_000, env: { OMP_NUM_THREADS: '1' } });
      expect(res.status, res.stderr.slice(-4000)).toBe(0);
      const out = JSON.parse(res.stdout.trim().split('\n').pop()!) as Record<string, number>;
      console.log(
        `examples/moe_router_replay.py: ${out.tokens} tokens, ${out.nodes_token_trie} nodes by tokens, ${out.nodes_route_split} split by routes; ` +
          `max differences: logprobs ${out.max_diff_logprobs}, aux ${out.max_diff_aux_loss}, gradients ${out.max_diff_gradients}`,
      );
      // The calls' routes conflict on shared prefixes: the tree splits there, and still shares something.
      expect(out.nodes_route_split).toBeGreaterThan(out.nodes_token_trie);
      expect(out.nodes_route_split).toBeLessThan(out.tokens);
      expect(out.max_diff_logprobs).toBeLessThan(1e-5);
      expect(out.max_diff_aux_loss).toBeLessThan(1e-6);
      expect(out.max_diff_gradients).toBeLessThan(1e-5);
      expect(out.max_diff_weights_after_step).toBeLessThan(1e-6);
      expect(out.without_replay_max_diff_logprobs).toBeGreaterThan(1e-3);
    },
  );

  it('examples/multimodal_tree.py: screenshots encoded once per distinct image, packed equals unpacked', { timeout: 600_000 }, () => {
    const res = py.run([join(root, 'examples', 'multimodal_tree.py')], { cwd: root, timeout: 590_000, env: { OMP_NUM_THREADS: '1' } });
    expect(res.status, res.stderr.slice(-4000)).toBe(0);
    const out = JSON.parse(res.stdout.trim().split('\n').pop()!) as Record<string, number>;
    console.log(
      `examples/multimodal_tree.py: ${out.naive_tokens} tokens in ${out.packed_tokens} nodes, ${out.images_sent} screenshots sent, ` +
        `encoded ${out.encoded_packed} packed vs ${out.encoded_unpacked} unpacked; max differences: logprobs ${out.max_diff_logprobs}, ` +
        `gradients ${out.max_diff_gradients}`,
    );
    expect(out.packed_tokens).toBeLessThan(out.naive_tokens);
    expect(out.encoded_packed).toBeLessThan(out.encoded_unpacked);
    expect(out.encoded_unpacked).toBe(out.images_sent);
    expect(out.max_diff_logprobs).toBeLessThan(1e-10);
    expect(out.max_diff_loss).toBeLessThan(1e-10);
    expect(out.max_diff_gradients).toBeLessThan(1e-10);
    expect(out.max_diff_vision_gradients).toBeLessThan(1e-10);
  });
});
