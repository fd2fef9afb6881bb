/**
 * `npm run bench:serve`: `treepack serve` on loopback with a stub engine that answers at once (a process of its
 * own, as a real engine is), on both pools in the same run: the in-process pool and the shared Redis pool
 * (`--redis`, on a redis-server this bench starts on loopback in a temporary directory and stops; skipped, with
 * the reason, where redis-server is absent).
 *  - latency the gateway adds: the same open-loop call rate (calls sent on a fixed schedule, whatever the answers
 *    do; an agent's 4 calls answered, it finishes its episode, which on Redis ships it there) sent to the engine
 *    directly, through two floor proxies (bench/serve-floor.ts, written apart from the gateway: bare node:http, and
 *    bare node:http with an O_DSYNC group-commit log: the least a Node proxy that answers after an fsync adds on
 *    this machine) and through each pool's gateway (a separate process; each answer waits for its record's
 *    fsync, group-committed), in
 *    alternating rounds so every path sees the same machine load, each path warmed up at the rate first (its
 *    first seconds reported apart); p50/p99 of each and their difference, the rates achieved, the load average
 *    (the 2 cores are shared); and, to explain them, from the service's own metrics over its rounds: its
 *    event-loop delay, its GC pauses, the CPU its main thread spent per call, and the disk's fdatasync time alone
 *    between rounds;
 *  - calls/s recorded at saturation: 32 clients calling back to back;
 *  - agent-sized calls: the requests of the tau-bench episodes in shared/data (each re-sends its whole context),
 *    replayed at a fixed rate, direct, through the durable floor and through the in-process gateway: latency
 *    added, main-thread CPU per call and log bytes per call (skipped, with the reason, without the file);
 *  - micro-batches/s to 8 trainer ranks (packing included), from records written through the rollout buffer,
 *    and the service's event-loop delay meanwhile;
 *  - what the durable hand-out record costs a pull (in-process pool), against the call log write;
 *  - memory under backpressure (in-process pool): agents that never finish, until the pool bound answers 429.
 * Goal (issue 11): <= 1 ms p99 added at 1k calls/s with a stub engine. Options: --quick, --json FILE, --rate R,
 * --agent-rate R (agent-sized calls/s, default 200), --data FILE (tau-bench episodes).
 */
import { spawn } from 'node:child_process';
import { Agent, request } from 'node:http';
import {
  closeSync,
  existsSync,
  fdatasyncSync,
  mkdtempSync,
  openSync,
  readFileSync,
  rmSync,
  statSync,
  writeFileSync,
  writeSync,
} from 'node:fs';
import { loadavg, tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { performance } from 'node:perf_hooks';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { redisAvailable, startRedis, type RedisServer } from '../test/helpers/redis.js';
import { freePort, startScript, terminate, type UrlProcess } from '../test/helpers/serve.js';
import { speed } from './format.js';

const { values } = parseArgs({
  options: {
    quick: { type: 'boolean' },
    json: { type: 'string' },
    rate: { type: 'string' },
    'agent-rate': { type: 'string' },
    data: { type: 'string' },
  },
});
const quick = values.quick === true;
const root = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const BIN = join(root, 'dist/src/cli/main.js');

const quantile = (xs: number[], q: number) => {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor(q * s.length))] ?? NaN;
};

async function serve(args: string[]): Promise<UrlProcess> {
  const port = await freePort();
  // The stub engine returns text without token ids: the gateways render it with the built-in Qwen3 template.
  const child = spawn(process.execPath, [BIN, 'serve', '--port', String(port), '--tokenizer', 'qwen3', ...args], {
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  let stderr = '';
  child.stderr.on('data', (d: Buffer) => (stderr = (stderr + d.toString()).slice(-4000)));
  const url = `http://127.0.0.1:${port}`;
  for (
    let i = 0;
    i < 600 &&
    !(await fetch(`${url}/healthz`).then(
      (r) => r.ok,
      () => false,
    ));
    i++
  ) {
    if (child.exitCode !== null) throw new Error(`treepack serve ${args.join(' ')} exited with ${child.exitCode}: ${stderr}`);
    await new Promise((r) => setTimeout(r, 100));
  }
  return { url, child, stop: () => terminate(child) };
}

/** A process of this bench (bench/serve-stub.ts, bench/serve-floor.ts): it prints its URL on its first line. */
const script = (file: string, args: string[]) => startScript(join(root, 'bench', file), args);

/** Keep-alive connections, as an agent framework's HTTP client holds them. */
const agent = new Agent({ keepAlive: true, maxSockets: 64 });

function postJson(url: string, body: string, headers: Record<string, string>): Promise<number> {
  return new Promise((res, rej) => {
    const req = request(
      url,
      { method: 'POST', agent, headers: { 'content-type': 'application/json', 'content-length': Buffer.byteLength(body), ...headers } },
      (r) => {
        r.resume();
        r.on('end', () => res(r.statusCode ?? 0));
      },
    );
    req.on('error', rej);
    req.end(body);
  });
}

/** One call of the load: the gateway or engine base URL (…/v1), its headers, and what follows its answer. */
interface Call {
  base: string;
  headers: Record<string, string>;
  /** the request body; default: a one-message chat */
  body?: string;
  /** run once the call is answered (not timed): an agent finishing its episode */
  then?: () => Promise<unknown>;
}

const chatBody = (i: number) => JSON.stringify({ model: 'm', messages: [{ role: 'user', content: `call ${i}` }] });

/**
 * Sends `rate` calls/s for `seconds` on a fixed schedule (open loop: a slow answer does not delay the next call);
 * per-call latency in ms and the rate the calls went out at.
 */
async function openLoop(
  rate: number,
  seconds: number,
  call: (i: number) => Call,
): Promise<{ ms: number[]; failed: number; sentPerS: number }> {
  const n = Math.round(rate * seconds);
  const ms: number[] = [];
  let failed = 0;
  const start = performance.now();
  let lastSent = start;
  const inflight: Promise<void>[] = [];
  for (let i = 0; i < n; i++) {
    const due = start + (i * 1000) / rate;
    const wait = due - performance.now();
    if (wait > 1) await new Promise((r) => setTimeout(r, wait));
    lastSent = performance.now();
    const c = call(i);
    inflight.push(
      (async () => {
        const t0 = performance.now();
        const status = await postJson(`${c.base}/chat/completions`, c.body ?? chatBody(i), c.headers).catch(() => 0);
        if (status === 200) ms.push(performance.now() - t0);
        else failed++;
        await c.then?.();
      })(),
    );
  }
  await Promise.all(inflight);
  return { ms, failed, sentPerS: n > 1 ? ((n - 1) * 1000) / (lastSent - start) : NaN };
}

/** Calls/s recorded with `clients` agents each calling back to back for `seconds` (a new episode every 4 calls). */
async function closedLoop(clients: number, seconds: number, call: (i: number) => Call): Promise<{ perS: number; failed: number }> {
  let done = 0,
    failed = 0,
    next = 0;
  const start = performance.now();
  const end = start + seconds * 1000;
  await Promise.all(
    Array.from({ length: clients }, async () => {
      while (performance.now() < end) {
        const i = next++;
        const c = call(i);
        if ((await postJson(`${c.base}/chat/completions`, chatBody(i), c.headers).catch(() => 0)) === 200) done++;
        else failed++;
        await c.then?.();
      }
    }),
  );
  return { perS: (done * 1000) / (performance.now() - start), failed };
}

/** The floor under "fsync'd before the answer": fdatasync of a small append to a file in `dir`, in ms. */
function fsyncFloor(dir: string, n: number): { p50: number; p99: number } {
  const fd = openSync(join(dir, 'fsync-probe'), 'a');
  const ms: number[] = [];
  for (let i = 0; i < n; i++) {
    writeSync(fd, '{"type":"call","probe":"' + 'x'.repeat(500) + '"}\n');
    const t = performance.now();
    fdatasyncSync(fd);
    ms.push(performance.now() - t);
  }
  closeSync(fd);
  return { p50: quantile(ms, 0.5), p99: quantile(ms, 0.99) };
}

const load = () =>
  loadavg()
    .map((x) => x.toFixed(2))
    .join(' ');
const mean = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / xs.length;
const ms3 = (x: number) => `${x.toFixed(3)} ms`;
const signed = (x: number) => (x < 0 ? `−${ms3(-x)}` : `+${ms3(x)}`);

/** One sample of a Prometheus text exposition: the value of `name` whose labels include `labels`. */
function sample(text: string, name: string, labels = ''): number {
  const esc = (x: string) => x.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
  const m = text.match(new RegExp(`^${esc(name)}(?:\\{[^}]*${esc(labels)}[^}]*\\})? (\\S+)$`, 'm'));
  return m ? Number(m[1]) : NaN;
}

/** What the serve child's own metrics say about one round: its event-loop delay and its GC pauses meanwhile. */
interface ProcessRound {
  loopP99: number;
  loopMax: number;
  gcMs: number;
  gcPauses: number;
  /** CPU time of the child's main thread (its event loop), ms */
  loopCpuMs: number;
  /** the log's group-commit writes in the round, by histogram bucket (cumulative, le in seconds) */
  logWrites: Map<string, number>;
}

/** The bucket bound (ms) under which a share `q` of the log's writes fell, over rounds. */
function logWriteQuantile(rounds: ProcessRound[], q: number): number {
  const total = new Map<string, number>();
  for (const r of rounds) for (const [le, n] of r.logWrites) total.set(le, (total.get(le) ?? 0) + n);
  const all = total.get('+Inf') ?? 0;
  for (const [le, n] of total) if (n >= q * all) return le === '+Inf' ? Infinity : Number(le) * 1000;
  return NaN;
}

/** CPU time a process's main thread has run, in ms (Linux schedstat: ns on the CPU); NaN elsewhere. */
function mainThreadCpuMs(pid: number): number {
  try {
    return Number(readFileSync(`/proc/${pid}/task/${pid}/schedstat`, 'utf8').split(' ')[0]) / 1e6;
  } catch {
    return NaN;
  }
}

/** Scrapes a service's /metrics: the loop-delay gauges reset at each scrape, GC pause sums are cumulative. */
async function scrape(
  url: string,
): Promise<{ loopP99: number; loopMax: number; gcSum: number; gcCount: number; logWrites: Map<string, number> }> {
  const text = await (await fetch(`${url}/metrics`)).text();
  const logWrites = new Map<string, number>();
  for (const m of text.matchAll(/^treepack_log_write_seconds_bucket\{le="([^"]+)"\} (\S+)$/gm)) logWrites.set(m[1], Number(m[2]));
  let gcSum = 0,
    gcCount = 0;
  for (const m of text.matchAll(/^treepack_gc_pause_seconds_(sum|count)\{[^}]*\} (\S+)$/gm)) {
    if (m[1] === 'sum') gcSum += Number(m[2]);
    else gcCount += Number(m[2]);
  }
  const loop = (q: string) => sample(text, 'treepack_event_loop_delay_seconds', `quantile="${q}"`) * 1000;
  return { loopP99: loop('0.99'), loopMax: loop('max'), gcSum, gcCount, logWrites };
}

/** One way to the engine whose latency is measured: direct, through a floor proxy, or through treepack serve. */
interface Path {
  /** its key in the JSON report */
  name: string;
  label: string;
  /** the calls of round `round` (-1: the warm-up) */
  call: (round: number) => (i: number) => Call;
  /** a treepack serve child, whose own metrics explain its rounds */
  service?: UrlProcess;
}

/** A pool under test: the flags that select it, each service on its own Redis database (their options differ). */
interface PoolUnderTest {
  name: string;
  args: (db: number) => string[];
}

/** One path's latencies over the rounds, and what its service's metrics said meanwhile. */
interface PathTimes {
  ms: number[];
  failed: number;
  sent: number[];
  /** latencies of its warm-up: its first seconds at the rate */
  cold: number[];
  process: ProcessRound[];
}

/** CPU its service's event loop ran per call of the rounds (finishes included), µs. */
const loopCpuPerCall = (a: PathTimes) => (a.process.reduce((t, x) => t + x.loopCpuMs, 0) * 1000) / (a.ms.length + a.failed);

/**
 * Warms each path up at `rate` for `warmSeconds`, then runs `rounds` alternating rounds of `seconds / rounds` on
 * each, so every path sees the same machine load; a service's metrics are scraped around each of its rounds.
 */
async function measure(
  paths: Path[],
  rate: number,
  seconds: number,
  rounds: number,
  warmSeconds: number,
  hooks: { beforeRounds?: () => unknown; betweenRounds?: () => unknown } = {},
): Promise<PathTimes[]> {
  const acc: PathTimes[] = [];
  for (const path of paths)
    acc.push({ ms: [], failed: 0, sent: [], cold: (await openLoop(rate, warmSeconds, path.call(-1))).ms, process: [] });
  await hooks.beforeRounds?.();
  for (let r = 0; r < rounds; r++) {
    for (const [k, path] of paths.entries()) {
      const gw = path.service;
      const before = gw && (await scrape(gw.url)); // also resets the child's loop-delay gauges
      const cpu0 = gw ? mainThreadCpuMs(gw.child.pid!) : 0;
      const got = await openLoop(rate, seconds / rounds, path.call(r));
      if (gw) {
        const loopCpuMs = mainThreadCpuMs(gw.child.pid!) - cpu0;
        const after = await scrape(gw.url);
        const logWrites = new Map([...after.logWrites].map(([le, n]) => [le, n - (before!.logWrites.get(le) ?? 0)]));
        acc[k].process.push({
          loopP99: after.loopP99,
          loopMax: after.loopMax,
          gcMs: (after.gcSum - before!.gcSum) * 1000,
          gcPauses: after.gcCount - before!.gcCount,
          loopCpuMs,
          logWrites,
        });
      }
      acc[k].ms.push(...got.ms);
      acc[k].failed += got.failed;
      acc[k].sent.push(got.sentPerS);
    }
    await hooks.betweenRounds?.();
  }
  return acc;
}

const report: Record<string, unknown> = {};
const stub = await script('serve-stub.ts', []);
const data = mkdtempSync(join(tmpdir(), 'tp-bench-serve-'));
let redis: RedisServer | undefined;
try {
  const pools: PoolUnderTest[] = [{ name: 'in-process', args: () => [] }];
  if (redisAvailable('bench:serve, the Redis pool')) {
    redis = await startRedis();
    const url = redis.url;
    pools.push({ name: 'redis', args: (db) => ['--redis', `${url}/${db}`] });
  } else report.redis = 'skipped: redis-server not found';

  // 1. Added latency at a fixed call rate, and calls/s recorded at saturation.
  const rate = Number(values.rate ?? 1000);
  const seconds = quick ? 2 : 5;
  const warmSeconds = quick ? 1 : 3;
  const gateways = await Promise.all(
    pools.map((p, k) => serve(['--engine', stub.url, '--data', join(data, `latency-${p.name}`), '--group-size', '1', ...p.args(1 + k)])),
  );
  const floors = await Promise.all([script('serve-floor.ts', [stub.url]), script('serve-floor.ts', [stub.url, join(data, 'floor.jsonl')])]);
  // Each agent makes 4 calls, then finishes its episode once all 4 are answered (on Redis the finish ships it to
  // the shared pool).
  const agentCall = (gw: string, tag: string) => {
    const answered = new Map<string, number>();
    return (i: number): Call => {
      const ep = `${tag}-${Math.floor(i / 4)}`;
      const then = async () => {
        const n = (answered.get(ep) ?? 0) + 1;
        answered.set(ep, n);
        if (n === 4) await postJson(`${gw}/v1/episodes/${ep}/finish`, '{"reward":1}', {});
      };
      return { base: `${gw}/v1`, headers: { 'x-treepack-episode': ep }, then };
    };
  };
  const paths: Path[] = [
    { name: 'direct', label: 'direct to the engine', call: () => () => ({ base: stub.url, headers: {} }) },
    { name: 'floor_http', label: 'floor, bare node:http proxy', call: (r) => agentCall(floors[0].url, `r${r}`) },
    { name: 'floor_durable', label: 'floor, bare proxy + an O_DSYNC group-commit log', call: (r) => agentCall(floors[1].url, `r${r}`) },
    ...gateways.map((gw, k) => ({
      name: pools[k].name,
      label: `treepack serve, ${pools[k].name} pool`,
      call: (r: number) => agentCall(gw.url, `r${r}-${k}`),
      service: gw,
    })),
  ];
  const floorWrites = async () => (await (await fetch(`${floors[1].url}/writes`)).json()) as number[];
  const rounds = quick ? 4 : 10;
  const fsyncs: { p50: number; p99: number }[] = [];
  const loadBefore = load();
  // A service's first seconds at this rate are slower (the JIT compiling its hot paths, connection pools growing):
  // each path runs that long before its timed rounds, and those first seconds are reported apart.
  const acc = await measure(paths, rate, seconds, rounds, warmSeconds, {
    // from the first round on: the rounds' writes
    beforeRounds: () => floorWrites(),
    // The disk's own speed, between rounds: it changes with what else the machine does.
    betweenRounds: () => fsyncs.push(fsyncFloor(data, 100)),
  });
  const loadAfter = load();
  const floorWriteMs = await floorWrites();
  const fsync = {
    p50: quantile(
      fsyncs.map((f) => f.p50),
      0.5,
    ),
    p99: quantile(
      fsyncs.map((f) => f.p99),
      0.5,
    ),
  };
  const capacity = [];
  for (const [k, gw] of gateways.entries()) capacity.push(await closedLoop(32, quick ? 1 : 2, agentCall(gw.url, `cap${k}`)));
  const lat: Record<string, unknown> = {
    rate,
    seconds,
    rounds,
    warm_seconds: warmSeconds,
    load_before: loadBefore,
    load_after: loadAfter,
    fdatasync_p50_ms: fsync.p50,
    fdatasync_p99_ms: fsync.p99,
  };
  const directP50 = quantile(acc[0].ms, 0.5),
    directP99 = quantile(acc[0].ms, 0.99);
  console.log(
    `latency at ${rate} calls/s offered, ${seconds} s per path in ${rounds} alternating rounds after ${warmSeconds} s of warm-up each; load average (1/5/15 min) ${loadBefore} before, ${loadAfter} after (2 cores, shared)`,
  );
  console.log(
    '  (the stub engine answers at once, in a process of its own; agents of 4 calls, each then finishing its episode, through the floors and the gateways)',
  );
  const byPath: Record<string, { p50: number; p99: number }> = {};
  for (const [k, path] of paths.entries()) {
    const a = acc[k];
    const p50 = quantile(a.ms, 0.5),
      p99 = quantile(a.ms, 0.99);
    byPath[path.name] = { p50, p99 };
    const r: Record<string, number> = {
      sent_per_s: mean(a.sent),
      calls: a.ms.length,
      failed: a.failed,
      p50_ms: p50,
      p99_ms: p99,
      cold_p99_ms: quantile(a.cold, 0.99),
    };
    if (k > 0) Object.assign(r, { added_p50_ms: p50 - directP50, added_p99_ms: p99 - directP99 });
    lat[path.name] = r;
    const added =
      k > 0
        ? `; added p50 ${ms3(r.added_p50_ms)}  p99 ${ms3(r.added_p99_ms)}${path.service ? `   goal p99 <= 1 ms: ${r.added_p99_ms <= 1 ? 'met' : 'NOT met'}` : ''}`
        : '';
    console.log(
      `  ${path.label}: sent at ${r.sent_per_s.toFixed(0)}/s, ${r.calls} answered, ${r.failed} failed; p50 ${ms3(p50)}  p99 ${ms3(p99)}${added}`,
    );
    console.log(`    its first ${warmSeconds} s at this rate (warm-up, not in the rounds): p99 ${ms3(r.cold_p99_ms)}`);
    if (path.name === 'floor_durable') {
      Object.assign(r, {
        log_writes: floorWriteMs.length,
        log_write_p50_ms: quantile(floorWriteMs, 0.5),
        log_write_p99_ms: quantile(floorWriteMs, 0.99),
      });
      console.log(
        `    its log's ${floorWriteMs.length} durable group-commit writes during the rounds: p50 ${ms3(r.log_write_p50_ms)}  p99 ${ms3(r.log_write_p99_ms)} (write submitted to callback: an answer waits for the one in flight, then its own)`,
      );
    }
    const gw = path.service;
    if (!gw) continue;
    // The service's own measure of what it adds (everything but the engine wait), from its histogram.
    const metrics = await (await fetch(`${gw.url}/metrics`)).text();
    const bucket = (le: string) =>
      Number(metrics.match(new RegExp(`treepack_gateway_seconds_bucket\\{[^}]*le="${le.replace('+', '\\+')}"[^}]*\\} (\\d+)`))?.[1] ?? NaN);
    const c = capacity[gateways.indexOf(gw)];
    Object.assign(r, {
      server_share_within_1ms: bucket('0.001') / bucket('+Inf'),
      // the serve child's event loop during its rounds: a call arriving in a stall waits for it
      event_loop_delay_p99_ms: quantile(
        a.process.map((x) => x.loopP99),
        0.5,
      ),
      event_loop_delay_max_ms: Math.max(...a.process.map((x) => x.loopMax)),
      gc_pause_ms_per_s: a.process.reduce((t, x) => t + x.gcMs, 0) / seconds,
      gc_pauses: a.process.reduce((t, x) => t + x.gcPauses, 0),
      // CPU its event loop spent per call (finishes included): at `rate` calls/s, the share of the loop that is busy
      loop_cpu_us_per_call: loopCpuPerCall(a),
      // the log's durable group-commit writes during the rounds (an answer waits for the one holding its event)
      log_write_p50_ms_at_most: logWriteQuantile(a.process, 0.5),
      log_write_p99_ms_at_most: logWriteQuantile(a.process, 0.99),
      saturated_calls_per_s: c.perS,
      saturated_failed: c.failed,
    });
    console.log(
      `    the service's histogram: ${(r.server_share_within_1ms * 100).toFixed(1)}% of calls had <= 1 ms added by the gateway (parse, record, fsync, answer)`,
    );
    console.log(
      `    its event loop during its rounds: delay p99 ${ms3(r.event_loop_delay_p99_ms)} (median over rounds), max ${ms3(r.event_loop_delay_max_ms)}; GC paused it ${r.gc_pauses} times, ${r.gc_pause_ms_per_s.toFixed(1)} ms per s; its thread ran ${r.loop_cpu_us_per_call.toFixed(0)} µs of CPU per call (${((r.loop_cpu_us_per_call * rate) / 1e4).toFixed(0)}% busy at ${rate}/s)`,
    );
    console.log(
      `    its log's durable group-commit writes meanwhile: p50 <= ${r.log_write_p50_ms_at_most} ms, p99 <= ${r.log_write_p99_ms_at_most} ms (histogram bucket bounds)`,
    );
    console.log(`    calls/s recorded, saturated (32 agents calling back to back): ${c.perS.toFixed(0)}, ${c.failed} failed`);
  }
  console.log(
    `  fdatasync of one small append on the log's disk, alone, between rounds: p50 ${ms3(fsync.p50)}  p99 ${ms3(fsync.p99)} (median over rounds; every durable answer waits for one, or for the rest of the one in flight and its own: group commit shares each between the calls that arrive meanwhile)`,
  );
  const floor = byPath.floor_durable;
  for (const p of pools) {
    const g = byPath[p.name];
    console.log(
      `  treepack serve (${p.name}) against the durable floor: p50 ${speed(floor.p50, g.p50)} (${signed(g.p50 - floor.p50)}), p99 ${speed(floor.p99, g.p99)} (${signed(g.p99 - floor.p99)})`,
    );
  }
  if (byPath.redis) {
    const [l, r] = [byPath['in-process'], byPath.redis];
    console.log(
      `  Redis pool against in-process: p50 ${speed(l.p50, r.p50)}, p99 ${speed(l.p99, r.p99)}; saturated calls/s ${speed(1 / capacity[0].perS, 1 / capacity[1].perS)}`,
    );
  }
  report.latency = lat;
  await Promise.all([...gateways, ...floors].map((g) => g.stop()));

  // 1b. Agent-sized calls: real agents re-send their whole context on every call.
  const tau = values.data ?? resolve(root, '../shared/data/tau_bench_gpt4o_airline.jsonl');
  if (!existsSync(tau)) {
    const skipped = `skipped: ${tau} not found (--data FILE: tau-bench episodes, shared/data/README.md)`;
    report.agent_calls = skipped;
    console.log(`agent-sized calls ${skipped}`);
  } else {
    const agentRate = Number(values['agent-rate'] ?? 200);
    type TauEpisode = { episode_id: string; requests: { messages: unknown[]; tools?: unknown[] | null }[] };
    const episodes = readFileSync(tau, 'utf8')
      .split('\n')
      .filter((l) => l.trim())
      .map((l) => JSON.parse(l) as TauEpisode);
    const requests = episodes.flatMap((ep) =>
      ep.requests.map((q, k) => ({
        episode: ep.episode_id,
        last: k === ep.requests.length - 1,
        body: JSON.stringify({ model: 'm', messages: q.messages, ...(q.tools && { tools: q.tools }) }),
      })),
    );
    const meanBody = mean(requests.map((q) => Buffer.byteLength(q.body)));
    const gwData = join(data, 'latency-agent');
    const floorLog = join(data, 'floor-agent.jsonl');
    const [gw, floor] = await Promise.all([
      serve(['--engine', stub.url, '--data', gwData, '--group-size', '1']),
      script('serve-floor.ts', [stub.url, floorLog]),
    ]);
    // Each pass over the file replays its episodes under new ids, each finished after its last call.
    const replay =
      (url: string, tag: string) =>
      (i: number): Call => {
        const q = requests[i % requests.length];
        const ep = `${tag}-${Math.floor(i / requests.length)}-${q.episode}`;
        return {
          base: `${url}/v1`,
          headers: { 'x-treepack-episode': ep },
          body: q.body,
          then: q.last ? () => postJson(`${url}/v1/episodes/${ep}/finish`, '{"reward":1}', {}) : undefined,
        };
      };
    const agentPaths: Path[] = [
      {
        name: 'direct',
        label: 'direct to the engine',
        call: () => (i) => ({ base: stub.url, headers: {}, body: requests[i % requests.length].body }),
      },
      { name: 'floor_durable', label: 'floor, bare proxy + an O_DSYNC group-commit log', call: (r) => replay(floor.url, `r${r}`) },
      { name: 'in-process', label: 'treepack serve, in-process pool', call: (r) => replay(gw.url, `r${r}`), service: gw },
    ];
    const agentSeconds = quick ? 2 : 6;
    const got = await measure(agentPaths, agentRate, agentSeconds, quick ? 2 : 6, quick ? 1 : 2);
    const answered = (a: PathTimes) => a.ms.length + a.cold.length;
    const out: Record<string, unknown> = {
      rate: agentRate,
      seconds: agentSeconds,
      requests: requests.length,
      episodes: episodes.length,
      mean_request_bytes: meanBody,
    };
    console.log(
      `agent-sized calls at ${agentRate} calls/s: the ${requests.length} requests of ${episodes.length} tau-bench episodes (${(meanBody / 1024).toFixed(1)} KiB of request body on average: every call re-sends its context), replayed as new episodes, each finished after its last call`,
    );
    const d = got[0];
    for (const [k, path] of agentPaths.entries()) {
      const a = got[k];
      const p50 = quantile(a.ms, 0.5),
        p99 = quantile(a.ms, 0.99);
      const r: Record<string, number> = { calls: a.ms.length, failed: a.failed, p50_ms: p50, p99_ms: p99 };
      let extra = '';
      if (k > 0) {
        Object.assign(r, { added_p50_ms: p50 - quantile(d.ms, 0.5), added_p99_ms: p99 - quantile(d.ms, 0.99) });
        const bytes = statSync(path.service ? join(gwData, 'events.jsonl') : floorLog).size;
        r.log_bytes_per_call = bytes / answered(a);
        extra = `; added p50 ${ms3(r.added_p50_ms)}  p99 ${ms3(r.added_p99_ms)}; its log grew ${(r.log_bytes_per_call / 1024).toFixed(1)} KiB per call`;
      }
      if (path.service) {
        r.loop_cpu_us_per_call = loopCpuPerCall(a);
        extra += `; its thread ran ${r.loop_cpu_us_per_call.toFixed(0)} µs of CPU per call`;
      }
      out[path.name] = r;
      console.log(`  ${path.label}: ${r.calls} answered, ${r.failed} failed; p50 ${ms3(p50)}  p99 ${ms3(p99)}${extra}`);
    }
    report.agent_calls = out;
    await Promise.all([gw.stop(), floor.stop()]);
  }

  // 2. Micro-batches/s to 8 ranks.
  const dp = 8;
  const groups = quick ? 16 : 64;
  const feedRates: Record<string, number> = {};
  report.feed = {};
  for (const [k, p] of pools.entries()) {
    const feed = await serve([
      '--engine',
      stub.url,
      '--data',
      join(data, `feed-${p.name}`),
      '--group-size',
      '4',
      '--groups-per-step',
      '4',
      '--dp',
      String(dp),
      '--max-tokens',
      '256',
      '--window',
      '8',
      ...p.args(4 + k),
    ]);
    const post = (path: string, body: unknown) =>
      fetch(`${feed.url}${path}`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });
    for (let g = 0; g < groups; g++) {
      await Promise.all(
        Array.from({ length: 4 }, (_, e) =>
          post('/buffer/write', {
            uid: `g${g}-${e}`,
            instance_id: `g${g}`,
            reward: e % 2,
            extra_info: {},
            messages: [
              { role: 'system', content: 'You are a helpful agent. '.repeat(20) },
              { role: 'user', content: `task ${g}: ${'details '.repeat(30)}` },
              { role: 'assistant', content: `answer ${e} ${'words '.repeat(40)}` },
            ],
          }).then((r) => r.arrayBuffer()),
        ),
      );
    }
    await scrape(feed.url); // resets its loop-delay gauges
    const tf = performance.now();
    let pulled = 0;
    await Promise.all(
      Array.from({ length: dp }, async (_, rank) => {
        for (;;) {
          const r = await fetch(`${feed.url}/v1/batches/next?rank=${rank}&wait=2`);
          if (r.status !== 200) return;
          await r.arrayBuffer();
          await (await post(`/v1/batches/${r.headers.get('x-treepack-id')}/ack`, {})).arrayBuffer();
          pulled++;
        }
      }),
    );
    const feedSeconds = (performance.now() - tf) / 1000 - 2; // the last poll of each rank waits 2 s for nothing
    const loop = await scrape(feed.url);
    await feed.stop();
    feedRates[p.name] = pulled / feedSeconds;
    (report.feed as Record<string, unknown>)[p.name] = {
      dp,
      groups,
      micro_batches: pulled,
      seconds: feedSeconds,
      micro_batches_per_s: pulled / feedSeconds,
      event_loop_delay_p99_ms: loop.loopP99,
      event_loop_delay_max_ms: loop.loopMax,
    };
    console.log(
      `trainer feed on the ${p.name} pool, dp = ${dp}: ${pulled} micro-batches from ${groups} groups of 4 in ${feedSeconds.toFixed(2)} s = ${(pulled / feedSeconds).toFixed(1)} micro-batches/s (packing each step included)`,
    );
    console.log(
      `  the service's event loop meanwhile (steps pack in a worker thread): delay p99 ${ms3(loop.loopP99)}, max ${ms3(loop.loopMax)}`,
    );
  }
  if (feedRates.redis)
    console.log(`  Redis pool against in-process: micro-batches/s ${speed(1 / feedRates['in-process'], 1 / feedRates.redis)}`);

  // 2b. What the durable hand-out record costs (in-process pool): a pull writes its micro-batch's lease to the log
  // before answering, so an ack after a restart is accepted once. One client at a time (no group commit sharing a
  // write): sequential calls on new episodes (one durable write each: the call log write), then pulls without
  // acknowledging (each writes the step's `take` and the micro-batch's `handout`), then their acks (one write each).
  {
    const n = quick ? 40 : 200;
    const hs = await serve([
      '--engine',
      stub.url,
      '--data',
      join(data, 'handout'),
      '--group-size',
      '1',
      '--groups-per-step',
      '1',
      '--window',
      String(n),
    ]);
    const writes = async () => {
      const text = await (await fetch(`${hs.url}/metrics`)).text();
      return { s: sample(text, 'treepack_log_write_seconds_sum'), n: sample(text, 'treepack_log_write_seconds_count') };
    };
    const phase = async (each: (i: number) => Promise<void>) => {
      const ms: number[] = [];
      const before = await writes();
      for (let i = 0; i < n; i++) {
        const t0 = performance.now();
        await each(i);
        ms.push(performance.now() - t0);
      }
      const after = await writes();
      return {
        p50: quantile(ms, 0.5),
        p99: quantile(ms, 0.99),
        writesPerOp: (after.n - before.n) / n,
        writeMs: ((after.s - before.s) / (after.n - before.n)) * 1000,
      };
    };
    const ok = async (r: Promise<Response>) => {
      const res = await r;
      await res.arrayBuffer();
      if (res.status !== 200) throw new Error(`hand-out bench: HTTP ${res.status}`);
      return res;
    };
    const call = await phase(
      async (i) =>
        void (await ok(
          fetch(`${hs.url}/v1/chat/completions`, {
            method: 'POST',
            headers: { 'content-type': 'application/json', 'x-treepack-episode': `h${i}` },
            body: JSON.stringify({ model: 'm', messages: [{ role: 'user', content: `task ${i}` }] }),
          }),
        )),
    );
    for (let i = 0; i < n; i++)
      await ok(
        fetch(`${hs.url}/v1/episodes/h${i}/finish`, {
          method: 'POST',
          headers: { 'content-type': 'application/json' },
          body: '{"reward":1}',
        }),
      );
    const ids: string[] = [];
    const pull = await phase(
      async () => void ids.push((await ok(fetch(`${hs.url}/v1/batches/next?wait=5`))).headers.get('x-treepack-id')!),
    );
    const ack = await phase(async (i) => void (await ok(fetch(`${hs.url}/v1/batches/${ids[i]}/ack`, { method: 'POST' }))));
    await hs.stop();
    // A pull's two writes are of the same size class (a line under 100 bytes): the hand-out's is their mean.
    const handoutMs = pull.writeMs;
    const h = {
      operations: n,
      call_p50_ms: call.p50,
      call_log_write_mean_ms: call.writeMs,
      call_log_writes_per_call: call.writesPerOp,
      pull_p50_ms: pull.p50,
      pull_p99_ms: pull.p99,
      pull_log_writes_per_pull: pull.writesPerOp,
      handout_write_mean_ms: handoutMs,
      ack_p50_ms: ack.p50,
      ack_log_write_mean_ms: ack.writeMs,
      handout_write_over_call_log_write: handoutMs / call.writeMs,
      pull_p50_over_pull_p50_without_handout_write: pull.p50 / (pull.p50 - handoutMs),
    };
    report.handout_record = h;
    console.log(
      `durable hand-out record (in-process pool, one client at a time, ${n} each): call p50 ${ms3(call.p50)} with ${call.writesPerOp.toFixed(2)} log writes of ${ms3(call.writeMs)} mean; pull p50 ${ms3(pull.p50)}, p99 ${ms3(pull.p99)} with ${pull.writesPerOp.toFixed(2)} writes (take, handout) of ${ms3(pull.writeMs)} mean; ack p50 ${ms3(ack.p50)}`,
    );
    console.log(
      `  the hand-out write: ${ms3(handoutMs)} = ${h.handout_write_over_call_log_write.toFixed(2)}× the call log write; a pull takes ${h.pull_p50_over_pull_p50_without_handout_write.toFixed(2)}× what it would without it (p50 less one write)`,
    );
  }

  // 3. Memory under backpressure.
  const bound = 8 << 20;
  const bp = await serve(['--engine', stub.url, '--data', join(data, 'bp'), '--max-pool-bytes', String(bound), '--group-size', '1']);
  let refused = 0,
    accepted = 0;
  const big = 'x'.repeat(16 << 10);
  for (let i = 0; i < 1200 && refused < 50; i++) {
    const r = await fetch(`${bp.url}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', 'x-treepack-episode': `never-${i}` },
      body: JSON.stringify({ model: 'm', messages: [{ role: 'user', content: big }] }),
    });
    await r.arrayBuffer();
    if (r.status === 429) refused++;
    else accepted++;
  }
  const rss = Number(readFileSync(`/proc/${bp.child.pid}/status`, 'utf8').match(/VmRSS:\s+(\d+)/)![1]) * 1024;
  await bp.stop();
  report.backpressure = { pool_bound_bytes: bound, accepted, refused_429: refused, service_rss_bytes: rss };
  console.log(
    `backpressure (in-process pool): pool bound ${bound >> 20} MiB, ${accepted} calls of 16 KiB accepted, then ${refused} answered 429; service RSS ${(rss / 2 ** 20).toFixed(0)} MiB`,
  );
} finally {
  await stub.stop();
  await redis?.stop();
  rmSync(data, { recursive: true, force: true });
  if (redis) rmSync(redis.dir, { recursive: true, force: true });
}
if (values.json) writeFileSync(values.json, JSON.stringify(report, null, 2));
