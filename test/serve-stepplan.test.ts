/**
 * Step plans through the service, end to end: agents' episodes recorded through the gateway of a service packing
 * with prefix reuse (dp 2), each trainer rank pulling its planned micro-batches with treepack.client.FeedClient
 * and running them through the step-plan executor (python/tests/trainer/feed_stepplan.py): the feed keeps each
 * rank's plan order, a trainer dying after the micro-batch that pushes the shared trunk is replaced by one that gets
 * the plan from its start, and loss, logprobs and every gradient equal the same sequences unsplit (float64).
 */
import { execFile } from 'node:child_process';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { describe, expect, it } from 'vitest';
import { inProcessServices } from './helpers/in-process.js';
import { enginePython, ROOT } from './helpers/serve.js';

const python = enginePython('test/serve-stepplan.test.ts');
const services = inProcessServices('tp-stepplan-');
const post = (url: string, body: unknown) =>
  fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });

interface Pulled {
  id: string;
  rank: number;
  step: number;
  feed_step: number;
  prefix_tokens: number;
  prefix_push: number[];
  prefix_release: number;
  nodes: number;
}

describe.skipIf(!python)('step plans through treepack serve', () => {
  it(
    "FeedClient ranks get their plans in order, a dead trainer's plan restarts whole, and training equals the unsplit forest (float64, tiny Qwen3 and Qwen3.5)",
    { timeout: 600_000 },
    async () => {
      const leaseS = 5; // long enough that the replacement asks while the dead trainer still holds the run, on a loaded machine
      const { base } = await services.start({
        groupSize: 4,
        dp: 2,
        leaseMs: leaseS * 1000,
        packer: { budget: { maxTokens: 64, prefixCacheTokens: 4096, dp: 2 } },
      });
      // One task, four agents: a long shared system prompt and task, then two turns each of their own.
      const system = `You are a careful agent. ${Array.from({ length: 30 }, (_, i) => `Rule ${i}: check step ${i}.`).join(' ')}`;
      for (let k = 0; k < 4; k++) {
        const ep = `agent-${k}`;
        const chat = async (messages: { role: string; content: string }[]) => {
          const res = await post(`${base}/groups/task/episodes/${ep}/v1/chat/completions`, { model: 'm', messages, max_tokens: 8 });
          expect(res.status).toBe(200);
          return ((await res.json()) as { choices: { message: { content: string } }[] }).choices[0].message.content;
        };
        const msgs = [
          { role: 'system', content: system },
          { role: 'user', content: 'Solve the task.' },
        ];
        msgs.push(
          { role: 'assistant', content: await chat(msgs) },
          { role: 'user', content: `Agent ${k}: ${'and more '.repeat(3 + 3 * k)}` },
        );
        await chat(msgs);
        expect((await post(`${base}/v1/episodes/${ep}/finish`, { reward: [1, 0, 0.5, 0.25][k] })).status).toBe(200);
      }
      const r = await promisify(execFile)(
        python!,
        [join(ROOT, 'python/tests/trainer/feed_stepplan.py'), base, '2', String(leaseS), 'qwen3', 'qwen3_5'],
        {
          encoding: 'utf8',
          env: { ...process.env, PYTHONPATH: join(ROOT, 'python'), OMP_NUM_THREADS: '1' },
          timeout: 580_000,
          maxBuffer: 16 << 20,
        },
      ).catch((err: Error & { stdout?: string; stderr?: string }) => ({
        stdout: err.stdout ?? '',
        stderr: `${err.stderr ?? ''}${String(err)}`,
      }));
      const got = JSON.parse(r.stdout.trim().split('\n').pop() ?? 'null') as {
        first: { id: string; prefix_push: number[]; prefix_tokens: number };
        during_lease: string | null;
        ranks: Pulled[][];
        results: Record<
          string,
          { loss: number; loss_diff: number; logprob_diff: number; same_sequences: boolean; grad_diff: number; pushed_tokens: number }
        >;
        control: string;
        acks: boolean[];
      } | null;
      expect(got, r.stderr.slice(-4000)).not.toBeNull();
      const g = got!;
      // The first micro-batch pushes the trunk; the replacement got nothing while the dead trainer's lease held.
      expect(g.first.prefix_push.length).toBeGreaterThan(0);
      expect(g.during_lease).toBeNull();
      // Each rank's micro-batches in plan order (consecutive steps), the replacement's from the dead one's first.
      expect(g.ranks[0][0].id).toBe(g.first.id);
      for (const [rank, mine] of g.ranks.entries()) {
        expect(mine.length).toBeGreaterThan(0);
        expect(mine.every((m) => m.rank === rank && m.feed_step === mine[0].feed_step)).toBe(true);
        expect(mine.map((m) => m.step)).toEqual(mine.map((_, i) => mine[0].step + i));
      }
      // The plan hangs micro-batches from cached prefixes (a prefix shared by more than one micro-batch of a rank).
      expect(g.ranks.flat().some((m) => m.prefix_tokens > 0 && m.prefix_push.length === 0)).toBe(true);
      for (const [family, res] of Object.entries(g.results)) {
        expect(res.same_sequences, family).toBe(true);
        expect(res.loss_diff, family).toBeLessThan(1e-10 * Math.max(1, Math.abs(res.loss)));
        expect(res.logprob_diff, family).toBeLessThan(1e-10);
        expect(res.grad_diff, family).toBeLessThan(1e-10);
        expect(res.pushed_tokens, family).toBeGreaterThan(0);
      }
      expect(Object.keys(g.results)).toEqual(['qwen3', 'qwen3_5']);
      // What a replacement used to get (rank 0's plan without its first micro-batch) cannot run: refused by name.
      expect(g.control).toMatch(/^E_INPUT: .*prefix_(push|release).*out of plan order/);
      expect(g.acks[g.acks.length - 1]).toBe(true); // the step is done once every rank acknowledged
    },
  );
});
