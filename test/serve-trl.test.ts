/**
 * TRL trained from a live `treepack serve` (issue 25, item 3): agents' episodes recorded through the gateway of a
 * `treepack serve` process in front of the stub engine (groups with a shared task, tool calls, multi-turn, rewards),
 * then TRL's trainer from treepack.integrations.trl fed by `FeedClient` (python/tests/trainer/feed_trl.py) for two
 * optimizer steps on a tiny float64 Qwen3, acknowledging what it trained. The reference is independent of the feed:
 * the episodes' records exported by the gateway, packed by `treepack pack` step by step, and trained through the
 * directory path (`PackedDataset`). Loss, every logged metric and every parameter after the steps must be equal;
 * every handed-out micro-batch acknowledged exactly once, and the feed empty afterwards. A second service replays
 * a copy of the first one's log (the same micro-batches): there the trainer dies mid-step (after pulling, before
 * acknowledging) and is restarted from its checkpoint; it gets the micro-batches again and ends equal to the reference.
 * The same comparison (python/tests/trainer/feed_trl_more.py) under DDP, two gloo processes each on its own
 * `FeedClient(rank=r, dp=2)` from `treepack serve --dp 2` against `treepack pack --dp 2` read per rank; and on step
 * plans, TRL on what `treepack serve --prefix-reuse` hands out against `treepack pack --prefix-reuse` from the directory.
 */
import { execFile } from 'node:child_process';
import { cpSync, mkdirSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { afterAll, describe, expect, it } from 'vitest';
import { loadTokenizer } from '../src/tokenize/tokenizer.js';
import { cli } from './helpers/cli.js';
import { enginePython, QWEN3_DIR, ROOT, startServeProcess, tempDir, type ServeProcess } from './helpers/serve.js';
import { startStubEngine, type StubEngine } from './helpers/stub-engine.js';

const python = enginePython('test/serve-trl.test.ts');
const post = (url: string, body: unknown) =>
  fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });

const GROUPS = 4;
const EPISODES = 4; // per group (--group-size)
const GROUPS_PER_STEP = 2;
const MAX_TOKENS = 400;
const PLAN_MAX_TOKENS = 128; // under a group's packed tokens: its micro-batches hang from its cached trunk
const PREFIX_CACHE = 4096; // --prefix-reuse: cached prefix tokens allowed
const DDP_MAX_TOKENS = 260; // under a group's packed tokens: a step is several micro-batches per rank
const PAD_MULTIPLE = 64; // pad nodes tell the stored forest (which has them) from one rebuilt from TRL's rows (which has not)
// What a restarted trainer waits out (one trainer per service: a lease running out while it trains hands nothing out twice).
const LEASE_S = 4;
const DIED = 75; // feed_trl.py's dying trainer
const TOOLS = [
  {
    type: 'function',
    function: {
      name: 'search',
      description: 'search the web',
      parameters: { type: 'object', properties: { query: { type: 'string' } }, required: ['query'] },
    },
  },
];
const SYSTEM = 'You are a careful agent. Check every fact with the search tool before you answer.';

type Msg = Record<string, unknown>;
type Events = [string, string][];
interface Diff {
  params: number;
  logs: number;
}
interface Report {
  tokens: {
    naive: number;
    packed: number;
    pad: number;
    micro_batches: number;
    sequences: number;
    holes: number;
    rows: number[];
    hanging: number;
  };
  reference_logs: Record<string, number>[];
  controls: Record<string, Diff>;
  feed: Diff & { events: Events; same_batches: boolean; nodes: number[]; stats: number[][] };
  restart: Diff & { died_events: Events; resumed_events: Events; died_logs: number; resumed_logs: number };
  reference_s: number;
  feed_s: number;
  controls_s: number;
  restart_s: number;
}
type Tokens = Report['tokens'];
interface DdpReport {
  tokens: Tokens[]; // per rank
  ranks: {
    wrapper: string;
    feed: Diff & { events: Events; same_batches: boolean };
    control: Diff;
    reference_s: number;
    control_s: number;
    feed_s: number;
  }[];
  ranks_params: number;
  processes_s: number;
}
interface Executed {
  pushed: number;
  computed: number;
  left_cached: number;
}
interface PlanReport {
  tokens: Tokens;
  prefix_tokens: number[];
  planned: { pushed_tokens: number; computed_tokens: number };
  reference: Executed;
  feed: Diff & Executed & { events: Events; same_batches: boolean };
  control: Diff;
  reference_s: number;
  control_s: number;
  feed_s: number;
}

/** Episode k of group g: a forced search call (even k), its result, a reply; then a follow-up turn for k < 3. */
async function episode(base: string, g: number, k: number): Promise<void> {
  const url = `${base}/groups/task-${g}/episodes/task-${g}-ep-${k}/v1/chat/completions`;
  const chat = async (messages: Msg[], extra: Msg = {}) => {
    const res = await post(url, { model: 'policy', messages, tools: TOOLS, max_tokens: 16, ...extra });
    expect(res.status, await res.clone().text()).toBe(200);
    return ((await res.json()) as { choices: { message: Msg }[] }).choices[0].message;
  };
  const msgs: Msg[] = [
    { role: 'system', content: SYSTEM },
    { role: 'user', content: `Task ${g}: what is the capital of country ${g}?` },
  ];
  if (k % 2 === 0) {
    const call = await chat(msgs, { tool_choice: { type: 'function', function: { name: 'search' } } });
    const tc = (call.tool_calls as { id: string }[])[0];
    msgs.push(
      { role: 'assistant', content: null, tool_calls: call.tool_calls },
      { role: 'tool', tool_call_id: tc.id, content: `Result ${g}.${k}: city ${g * 7 + k}.` },
    );
  }
  msgs.push(await chat(msgs));
  if (k < 3) {
    msgs.push({ role: 'user', content: `Are you sure${'?'.repeat(k + 1)}` });
    await chat(msgs);
  }
}

let stub: StubEngine | undefined;
const serves: ServeProcess[] = [];
const dir = tempDir('tp-serve-trl-');
afterAll(async () => {
  for (const s of serves) await s.kill9();
  await stub?.close();
  rmSync(dir, { recursive: true, force: true }); // the checkpoint of a 150k-vocabulary model: a quarter GB
});

/** A `treepack serve` process logging to DIR/data in front of the stub engine, packing with `packing` (flags as `treepack pack`'s). */
async function serve(data: string, packing: string[]): Promise<ServeProcess> {
  stub ??= await startStubEngine('ok', { tokenizer: await loadTokenizer('qwen3') });
  const s = await startServeProcess([
    '--engine',
    stub.url,
    '--data',
    join(dir, data),
    '--tokenizer',
    'qwen3',
    '--group-size',
    String(EPISODES),
    '--groups-per-step',
    String(GROUPS_PER_STEP),
    '--window',
    String(GROUPS),
    '--lease',
    String(LEASE_S),
    ...packing,
  ]);
  serves.push(s);
  return s;
}

/** Every group's episodes through the gateway of `base`, each finished with its reward. */
async function recordEpisodes(base: string): Promise<void> {
  for (let g = 0; g < GROUPS; g++) {
    for (let k = 0; k < EPISODES; k++) {
      await episode(base, g, k);
      expect((await post(`${base}/v1/episodes/task-${g}-ep-${k}/finish`, { reward: ((g + 3 * k) % 5) / 4 })).status).toBe(200);
    }
  }
}

/**
 * The reference: each step's records exported by the gateway (its groups in order, as the feed packs them), packed
 * by `treepack pack` with the service's `packing` flags into DIR/NAME-stepS; the step directories.
 */
async function packSteps(base: string, name: string, packing: string[]): Promise<string[]> {
  const steps: string[] = [];
  for (let s = 0; s < GROUPS / GROUPS_PER_STEP; s++) {
    let jsonl = '';
    for (let g = s * GROUPS_PER_STEP; g < (s + 1) * GROUPS_PER_STEP; g++) {
      for (let k = 0; k < EPISODES; k++) jsonl += await (await fetch(`${base}/v1/episodes/task-${g}-ep-${k}/records`)).text();
    }
    const input = join(dir, `${name}-step${s}.jsonl`);
    writeFileSync(input, jsonl);
    const out = join(dir, `${name}-step${s}`);
    const r = cli(['pack', input, '--out', out, '--tokenizer', 'qwen3', '--timeline-compare-level', 'token', ...packing, '--quiet']);
    expect(r.code, r.stderr).toBe(0);
    steps.push(out);
  }
  return steps;
}

/** A service NAME packing with `packing`, every episode recorded through it, and the reference's step directories. */
async function recorded(name: string, packing: string[]): Promise<{ s: ServeProcess; steps: string[] }> {
  const s = await serve(name, packing);
  await recordEpisodes(s.url);
  return { s, steps: await packSteps(s.url, `${name}-reference`, packing) };
}

/** The driver's spec (DIR/NAME-work/given.json): the feed, the reference steps, the tokenizer, its work directory, and `more`. */
function writeSpec(name: string, feed: string, steps: string[], more: Record<string, unknown> = {}): string {
  const work = join(dir, `${name}-work`);
  mkdirSync(work);
  const spec = join(work, 'given.json');
  writeFileSync(spec, JSON.stringify({ feed, reference: steps, tokenizer: QWEN3_DIR, work, ...more }));
  return spec;
}

/** A Python driver's run on SPEC (a JSON file); its exit code, stdout and stderr. */
function runDriver(script: string, phase: string, spec: string) {
  return promisify(execFile)(python!, [join(ROOT, 'python/tests/trainer', script), phase, spec], {
    encoding: 'utf8',
    env: { ...process.env, PYTHONPATH: join(ROOT, 'python'), OMP_NUM_THREADS: '1' },
    timeout: 280_000,
    maxBuffer: 16 << 20,
  }).then(
    (r) => ({ ...r, code: 0 }),
    (err: Error & { stdout?: string; stderr?: string; code?: number }) => ({
      stdout: err.stdout ?? '',
      stderr: `${err.stderr ?? ''}${String(err)}`,
      code: err.code,
    }),
  );
}

/** The driver's last stdout line as JSON, or undefined after `ctx.skip` where it printed `{"skip": reason}`. */
function report<T>(r: { stdout: string; stderr: string; code?: number }, ctx: { skip: (reason: string) => void }): T | undefined {
  expect(r.code, r.stderr.slice(-4000)).toBe(0);
  const got = JSON.parse(r.stdout.trim().split('\n').pop()!) as T & { skip?: string };
  if (got.skip !== undefined) {
    console.log(`test/serve-trl.test.ts skipped: ${got.skip}`);
    ctx.skip(got.skip);
    return undefined;
  }
  return got;
}

/** Micro-batch ids of `steps` steps of `perStep` each ("step.index"), and a window's events. */
function windows(steps: number, perStep: number) {
  const ids = Array.from({ length: steps * perStep }, (_, i) => `${Math.floor(i / perStep)}.${i % perStep}`);
  return { ids, window: (w: number, what: string, of = ids) => of.slice(w * perStep, (w + 1) * perStep).map((id) => [what, id]) };
}

/** The service handed out and had acknowledged every micro-batch once (`reissued` handed out again), nothing left. */
async function expectDrained(base: string, steps: number, ids: string[], reissued: number): Promise<void> {
  const feed = (await (await fetch(`${base}/v1/feed`)).json()) as {
    trainer_version: number;
    micro_batches_ready: number;
    micro_batches_leased: number;
  };
  expect(feed).toMatchObject({ trainer_version: steps, micro_batches_ready: 0, micro_batches_leased: 0 });
  expect((await fetch(`${base}/v1/batches/next?wait=0`)).status).toBe(204);
  for (const id of ids) {
    const again = await post(`${base}/v1/batches/${id}/ack`, {});
    expect(again.status, id).toBe(200); // a repeated ack is answered and changes nothing
    expect(await again.json(), id).toMatchObject({ repeated: true, step_done: true });
  }
  const metrics = await (await fetch(`${base}/metrics`)).text();
  const count = (event: string) => Number(new RegExp(`treepack_micro_batches_total\\{event="${event}"\\} (\\d+)`).exec(metrics)?.[1] ?? 0);
  expect([count('packed'), count('handed_out'), count('reissued'), count('acked')]).toEqual([ids.length, ids.length, reissued, ids.length]);
}

describe.skipIf(!python)('TRL trained from treepack serve through FeedClient', () => {
  it(
    "equals the directory path on the gateway's exported records, acks each micro-batch once, survives a trainer dying mid-step (float64 tiny Qwen3)",
    { timeout: 600_000 },
    async (ctx) => {
      const t0 = Date.now();
      const packing = ['--max-tokens', String(MAX_TOKENS), '--pad-multiple', String(PAD_MULTIPLE)];
      const { s: a, steps } = await recorded('a', packing);
      // Service B replays a copy of A's log: the same steps, the same micro-batches, for the trainer that dies.
      cpSync(join(dir, 'a'), join(dir, 'b'), { recursive: true });
      const b = await serve('b', packing);
      const spec = writeSpec('a', a.url, steps, { restart: b.url });
      const t1 = Date.now();
      const died = await runDriver('feed_trl.py', 'first', spec);
      const t2 = Date.now();
      if (died.code === 0 && died.stdout.includes('"skip"')) return void report(died, ctx);
      expect(died.code, died.stderr.slice(-4000)).toBe(DIED);
      const resumed = await runDriver('feed_trl.py', 'resume', spec);
      const t3 = Date.now();
      const got = report<Report>(resumed, ctx)!;
      const micro = got.tokens.micro_batches;
      const perStep = micro / steps.length;
      const { ids, window } = windows(steps.length, perStep);
      // What was trained: every group's episodes, merged per episode (tool calls and follow-ups continue the
      // context), loss-mask holes where tool results and user turns sit, each step a window of several micro-batches.
      expect(got.tokens.sequences).toBe(GROUPS * EPISODES);
      expect(got.tokens.holes).toBe(GROUPS * 3); // every episode but the last of each group (one reply, no tool)
      expect(perStep).toBeGreaterThan(1);
      expect(got.tokens.packed).toBeLessThan(got.tokens.naive / 2);
      expect(got.reference_logs).toHaveLength(steps.length);
      // TRL on the feed: the very micro-batches of the reference, trained to the same loss, metrics and parameters;
      // each window acknowledged after its optimizer step, before the next is pulled (an on-policy loop's agents see
      // the trainer version advance while the trainer waits for their next round).
      expect(got.feed.same_batches).toBe(true);
      expect(got.feed.params).toBeLessThanOrEqual(1e-10);
      expect(got.feed.logs).toBeLessThanOrEqual(1e-10);
      expect(got.feed.events).toEqual(steps.flatMap((_, w) => [...window(w, 'pulled'), ...window(w, 'acked')]));
      expect(got.tokens.pad).toBeGreaterThan(0);
      expect(got.feed.nodes.every((n) => n % PAD_MULTIPLE === 0)).toBe(true);
      for (const [tokens, nodes] of got.feed.stats) {
        expect(got.feed.nodes).toContain(nodes); // every forward ran on a stored forest, pad nodes included
        expect(tokens).toBeGreaterThan(nodes);
      }
      // The comparison can fail: another advantage on one micro-batch, or one micro-batch trained twice in place of another.
      for (const [name, c] of Object.entries(got.controls)) {
        expect(c.params, name).toBeGreaterThan(1e-4);
        expect(c.logs, name).toBeGreaterThan(1e-4);
      }
      expect(Object.keys(got.controls)).toEqual(['advantage', 'twice']);
      // The trainer that died in step 2 had acknowledged step 1 and pulled step 2; restarted from its step-1
      // checkpoint it got step 2's micro-batches again, and ends where the reference ends.
      expect(got.restart.died_events).toEqual([...window(0, 'pulled'), ...window(0, 'acked'), ...window(1, 'pulled')]);
      expect(got.restart.resumed_events).toEqual([...window(1, 'pulled'), ...window(1, 'acked')]);
      expect([got.restart.died_logs, got.restart.resumed_logs]).toEqual([1, 1]);
      expect(got.restart.params).toBeLessThanOrEqual(1e-10);
      expect(got.restart.logs).toBeLessThanOrEqual(1e-10);
      // The services agree: every micro-batch acknowledged exactly once, nothing left to hand out.
      await expectDrained(a.url, steps.length, ids, 0);
      await expectDrained(b.url, steps.length, ids, perStep);
      console.log(
        `test/serve-trl.test.ts: ${steps.length} optimizer steps of ${perStep} micro-batches, ${got.tokens.sequences} sequences, ` +
          `${got.tokens.naive} tokens packed to ${got.tokens.packed} (${got.tokens.pad} of them pad); max |Δ| parameters feed ${got.feed.params}, restarted ${got.restart.params}, ` +
          `logged metrics ${got.feed.logs} / ${got.restart.logs}; controls ${JSON.stringify(got.controls)}; ` +
          `TRL runs: reference ${got.reference_s.toFixed(1)} s, 2 controls ${got.controls_s.toFixed(1)} s, feed ${got.feed_s.toFixed(1)} s, resumed ${got.restart_s.toFixed(1)} s; ` +
          `episodes and packing ${((t1 - t0) / 1000).toFixed(1)} s, Python processes ${((t2 - t1) / 1000).toFixed(1)} s + ${((t3 - t2) / 1000).toFixed(1)} s; whole test ${((Date.now() - t0) / 1000).toFixed(1)} s`,
      );
    },
  );

  const ddpPackings = [
    ['plain', ['--max-tokens', String(DDP_MAX_TOKENS), '--dp', '2']],
    ['plans', ['--max-tokens', String(PLAN_MAX_TOKENS), '--prefix-reuse', String(PREFIX_CACHE), '--dp', '2']],
  ] as const;
  it.for(ddpPackings)(
    'under DDP (%s): one FeedClient(rank=r, dp=2) per rank from `treepack serve --dp 2` equals `treepack pack --dp 2` trained from the directory (two gloo processes, float64 tiny Qwen3)',
    { timeout: 600_000 },
    async ([variant, flags], ctx) => {
      const t0 = Date.now();
      const packing = [...flags];
      const { s, steps } = await recorded(`ddp-${variant}`, packing);
      const spec = writeSpec(`ddp-${variant}`, s.url, steps);
      const t1 = Date.now();
      const got = report<DdpReport>(await runDriver('feed_trl_more.py', 'ddp', spec), ctx);
      if (!got) return;
      const perRank = got.tokens[0].micro_batches / steps.length; // micro-batches per rank and step
      const perStep = perRank * 2;
      const { ids } = windows(steps.length, perStep);
      expect(got.tokens.map((t) => t.micro_batches)).toEqual([perRank * steps.length, perRank * steps.length]);
      expect(got.tokens[0].sequences + got.tokens[1].sequences).toBe(GROUPS * EPISODES);
      expect(Math.min(got.tokens[0].sequences, got.tokens[1].sequences)).toBeGreaterThan(0);
      // A step plan's micro-batches hang from their rank's cached trunk (every rank's); the plain packing has no plan.
      for (const t of got.tokens) expect(t.hanging > 0).toBe(variant === 'plans');
      for (const [rank, r] of got.ranks.entries()) {
        // Each rank trained its own share of the service's micro-batches, under DDP, to the reference's loss, metrics and parameters.
        expect(r.wrapper, `rank ${rank}`).toBe('DistributedDataParallel');
        expect(r.feed.same_batches, `rank ${rank}`).toBe(true);
        expect(r.feed.params, `rank ${rank}`).toBeLessThanOrEqual(1e-10);
        expect(r.feed.logs, `rank ${rank}`).toBeLessThanOrEqual(1e-10);
        // Its windows in order, each acknowledged when the next is drawn (after the optimizer step), the last at the end.
        const pulled = r.feed.events.filter(([e]) => e === 'pulled').map(([, id]) => id);
        expect(pulled).toHaveLength(perRank * steps.length);
        const mine = windows(steps.length, perRank);
        expect(r.feed.events).toEqual(steps.flatMap((_, w) => [...mine.window(w, 'pulled', pulled), ...mine.window(w, 'acked', pulled)]));
        expect(pulled.map((id) => Number(id.split('.')[0]))).toEqual(steps.flatMap((_, w) => Array<number>(perRank).fill(w)));
        // The comparison can fail: every rank training rank 0's micro-batches (a feed that ignored the rank) differs.
        expect(r.control.params, `rank ${rank}`).toBeGreaterThan(1e-4);
        expect(r.control.logs, `rank ${rank}`).toBeGreaterThan(1e-4);
      }
      expect(
        [...got.ranks[0].feed.events, ...got.ranks[1].feed.events]
          .filter(([e]) => e === 'pulled')
          .map(([, id]) => id)
          .sort(),
      ).toEqual([...ids].sort());
      expect(got.ranks_params).toBe(0);
      await expectDrained(s.url, steps.length, ids, 0);
      const sum = (k: 'sequences' | 'naive' | 'packed') => got.tokens[0][k] + got.tokens[1][k];
      console.log(
        `test/serve-trl.test.ts (DDP, ${variant}): ${steps.length} optimizer steps of ${perRank} micro-batches per rank, ${sum('sequences')} sequences (rows ${JSON.stringify(got.tokens.map((t) => t.rows))}), ` +
          `${sum('naive')} tokens packed to ${sum('packed')} (rank 0 ${got.tokens[0].packed}, rank 1 ${got.tokens[1].packed}); max |Δ| parameters ${got.ranks.map((r) => r.feed.params).join(' / ')}, ` +
          `logged metrics ${got.ranks.map((r) => r.feed.logs).join(' / ')}; control ${JSON.stringify(got.ranks.map((r) => r.control))}; ` +
          `rank 0 TRL runs: reference ${got.ranks[0].reference_s.toFixed(1)} s, control ${got.ranks[0].control_s.toFixed(1)} s, feed ${got.ranks[0].feed_s.toFixed(1)} s; ` +
          `episodes and packing ${((t1 - t0) / 1000).toFixed(1)} s, Python ${got.processes_s.toFixed(1)} s in the 2 processes, whole test ${((Date.now() - t0) / 1000).toFixed(1)} s`,
      );
    },
  );

  it(
    'on step plans: TRL on what `treepack serve --prefix-reuse` hands out equals `treepack pack --prefix-reuse` trained from the directory (float64 tiny Qwen3)',
    { timeout: 600_000 },
    async (ctx) => {
      const t0 = Date.now();
      const packing = ['--max-tokens', String(PLAN_MAX_TOKENS), '--prefix-reuse', String(PREFIX_CACHE)];
      const { s, steps } = await recorded('plan', packing);
      const spec = writeSpec('plan', s.url, steps);
      const t1 = Date.now();
      const got = report<PlanReport>(await runDriver('feed_trl_more.py', 'plan', spec), ctx);
      if (!got) return;
      const perStep = got.tokens.micro_batches / steps.length;
      const { ids, window } = windows(steps.length, perStep);
      expect(got.tokens.sequences).toBe(GROUPS * EPISODES);
      // A plan: micro-batches hang from cached prefixes; the executor pushed and computed what the plan says, once.
      expect(got.prefix_tokens.filter((n) => n > 0).length).toBeGreaterThan(0);
      expect(got.planned.pushed_tokens).toBeGreaterThan(0);
      for (const run of [got.reference, got.feed]) {
        expect([run.pushed, run.computed, run.left_cached]).toEqual([got.planned.pushed_tokens, got.planned.computed_tokens, 0]);
      }
      expect(got.feed.same_batches).toBe(true);
      expect(got.feed.params).toBeLessThanOrEqual(1e-10);
      expect(got.feed.logs).toBeLessThanOrEqual(1e-10);
      expect(got.feed.events).toEqual(steps.flatMap((_, w) => [...window(w, 'pulled'), ...window(w, 'acked')]));
      expect(got.control.params).toBeGreaterThan(1e-4);
      expect(got.control.logs).toBeGreaterThan(1e-4);
      await expectDrained(s.url, steps.length, ids, 0);
      console.log(
        `test/serve-trl.test.ts (step plans): ${steps.length} optimizer steps of ${perStep} micro-batches, ${got.tokens.sequences} sequences, ` +
          `${got.tokens.naive} tokens packed to ${got.tokens.packed}, prefixes [${got.prefix_tokens.join(', ')}], planned pushed ${got.planned.pushed_tokens} + computed ${got.planned.computed_tokens} tokens; ` +
          `max |Δ| parameters ${got.feed.params}, logged metrics ${got.feed.logs}; control ${JSON.stringify(got.control)}; ` +
          `TRL runs: reference ${got.reference_s.toFixed(1)} s, control ${got.control_s.toFixed(1)} s, feed ${got.feed_s.toFixed(1)} s; ` +
          `episodes and packing ${((t1 - t0) / 1000).toFixed(1)} s, whole test ${((Date.now() - t0) / 1000).toFixed(1)} s`,
      );
    },
  );
});
