/**
 * `npm run bench:serve`: `treepack serve` on loopback with a stub engine that answers at once.
 *  - latency the gateway adds: the same open-loop call rate (calls sent on a fixed schedule, whatever the answers
 *    do) sent to the engine directly and through the gateway (a separate process; each answer waits for its
 *    record's fsync, group-committed), in alternating rounds so both paths see the same machine load; p50/p99 of
 *    each and their difference, the rate achieved, the load average (the 2 cores are shared);
 *  - micro-batches/s to 8 trainer ranks (packing included), from records written through the rollout buffer;
 *  - memory under backpressure: agents that never finish, until the pool bound answers 429.
 * Goal (issue 11): <= 1 ms p99 added at 1k calls/s with a stub engine. Options: --quick, --json FILE.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { Agent, request } from 'node:http';
import { closeSync, fdatasyncSync, mkdtempSync, openSync, readFileSync, rmSync, writeFileSync, writeSync } from 'node:fs';
import { loadavg, tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { performance } from 'node:perf_hooks';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { startStubEngine } from '../test/helpers/stub-engine.js';

const { values } = parseArgs({ options: { quick: { type: 'boolean' }, json: { type: 'string' }, rate: { type: 'string' } } });
const quick = values.quick === true;
const root = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const BIN = join(root, 'dist/src/cli/main.js');

const quantile = (xs: number[], q: number) => {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor(q * s.length))] ?? NaN;
};

async function serve(args: string[]): Promise<{ url: string; child: ChildProcess; stop: () => Promise<void> }> {
  const port = 20000 + Math.floor(Math.random() * 20000);
  const child = spawn(process.execPath, [BIN, 'serve', '--port', String(port), ...args], { stdio: ['ignore', 'ignore', 'pipe'] });
  const url = `http://127.0.0.1:${port}`;
  for (let i = 0; i < 600 && !(await fetch(`${url}/healthz`).then((r) => r.ok, () => false)); i++) await new Promise((r) => setTimeout(r, 100));
  return { url, child, stop: () => new Promise((r) => (child.once('exit', () => r()), child.kill('SIGTERM'))) };
}

/** Keep-alive connections, as an agent framework's HTTP client holds them. */
const agent = new Agent({ keepAlive: true, maxSockets: 64 });

function postJson(url: string, body: string, headers: Record<string, string>): Promise<number> {
  return new Promise((res, rej) => {
    const req = request(url, { method: 'POST', agent, headers: { 'content-type': 'application/json', 'content-length': Buffer.byteLength(body), ...headers } }, (r) => {
      r.resume();
      r.on('end', () => res(r.statusCode ?? 0));
    });
    req.on('error', rej);
    req.end(body);
  });
}

/**
 * Sends `rate` calls/s for `seconds` on a fixed schedule (open loop: a slow answer does not delay the next call),
 * each to a new or running episode; per-call latency in ms, and the rate the calls actually went out at.
 */
async function openLoop(url: string, rate: number, seconds: number, headers: (i: number) => Record<string, string>): Promise<{ ms: number[]; failed: number; sentPerS: number }> {
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
    inflight.push(
      (async () => {
        const t0 = performance.now();
        const status = await postJson(`${url}/chat/completions`, JSON.stringify({ model: 'm', messages: [{ role: 'user', content: `call ${i}` }] }), headers(i)).catch(() => 0);
        if (status === 200) ms.push(performance.now() - t0);
        else failed++;
      })(),
    );
  }
  await Promise.all(inflight);
  return { ms, failed, sentPerS: n > 1 ? ((n - 1) * 1000) / (lastSent - start) : NaN };
}

/** The floor under "fsync'd before the answer": fdatasync of a small append to a file in `dir`, in ms. */
function fsyncFloor(dir: string): { p50: number; p99: number } {
  const fd = openSync(join(dir, 'fsync-probe'), 'a');
  const ms: number[] = [];
  for (let i = 0; i < 300; i++) {
    writeSync(fd, '{"type":"call","probe":"' + 'x'.repeat(500) + '"}\n');
    const t = performance.now();
    fdatasyncSync(fd);
    ms.push(performance.now() - t);
  }
  closeSync(fd);
  return { p50: quantile(ms, 0.5), p99: quantile(ms, 0.99) };
}

const load = () => loadavg().map((x) => x.toFixed(2)).join(' ');

const report: Record<string, unknown> = {};
const stub = await startStubEngine();
const data = mkdtempSync(join(tmpdir(), 'tp-bench-serve-'));
try {
  // 1. Added latency at a fixed call rate.
  const rate = Number(values.rate ?? 1000);
  const seconds = quick ? 2 : 5;
  const gw = await serve(['--engine', stub.url, '--data', join(data, 'latency'), '--group-size', '1']);
  await openLoop(stub.url, 200, 0.5, () => ({})); // warm both paths
  await openLoop(`${gw.url}/v1`, 200, 0.5, (i) => ({ 'x-treepack-episode': `warm-${i % 50}` }));
  const loadBefore = load();
  const direct = { ms: [] as number[], failed: 0, sent: [] as number[] };
  const through = { ms: [] as number[], failed: 0, sent: [] as number[] };
  const rounds = quick ? 4 : 10;
  let episode = 0;
  for (let r = 0; r < rounds; r++) {
    const d = await openLoop(stub.url, rate, seconds / rounds, () => ({}));
    const g = await openLoop(`${gw.url}/v1`, rate, seconds / rounds, () => ({ 'x-treepack-episode': `ep-${episode++ % 200}` }));
    for (const [acc, got] of [[direct, d], [through, g]] as const) {
      acc.ms.push(...got.ms);
      acc.failed += got.failed;
      acc.sent.push(got.sentPerS);
    }
  }
  const loadAfter = load();
  const floor = fsyncFloor(data);
  // The service's own measure of what it adds (everything but the engine wait), from its histogram.
  const metrics = await (await fetch(`${gw.url}/metrics`)).text();
  const bucket = (le: string) => Number(metrics.match(new RegExp(`treepack_gateway_seconds_bucket\\{[^}]*le="${le.replace('+', '\\+')}"[^}]*\\} (\\d+)`))?.[1] ?? NaN);
  const within1ms = bucket('0.001') / bucket('+Inf');
  await gw.stop();
  const mean = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / xs.length;
  const lat = {
    rate,
    seconds,
    rounds,
    calls: through.ms.length,
    failed: through.failed + direct.failed,
    direct_sent_per_s: mean(direct.sent),
    gateway_sent_per_s: mean(through.sent),
    direct_p50_ms: quantile(direct.ms, 0.5),
    direct_p99_ms: quantile(direct.ms, 0.99),
    gateway_p50_ms: quantile(through.ms, 0.5),
    gateway_p99_ms: quantile(through.ms, 0.99),
    added_p50_ms: quantile(through.ms, 0.5) - quantile(direct.ms, 0.5),
    added_p99_ms: quantile(through.ms, 0.99) - quantile(direct.ms, 0.99),
    server_share_within_1ms: within1ms,
    fdatasync_p50_ms: floor.p50,
    fdatasync_p99_ms: floor.p99,
    load_before: loadBefore,
    load_after: loadAfter,
  };
  report.latency = lat;
  console.log(`gateway at ${rate} calls/s offered, ${seconds} s per path in ${rounds} alternating rounds; load average (1/5/15 min) ${loadBefore} before, ${loadAfter} after (2 cores, shared)`);
  console.log(`  sent at ${lat.direct_sent_per_s.toFixed(0)}/s direct and ${lat.gateway_sent_per_s.toFixed(0)}/s through the gateway; ${lat.calls} calls recorded, ${lat.failed} failed`);
  console.log(`  direct  p50 ${lat.direct_p50_ms.toFixed(3)} ms  p99 ${lat.direct_p99_ms.toFixed(3)} ms`);
  console.log(`  gateway p50 ${lat.gateway_p50_ms.toFixed(3)} ms  p99 ${lat.gateway_p99_ms.toFixed(3)} ms  (fsync'd log, JSON re-encode)`);
  console.log(`  added   p50 ${lat.added_p50_ms.toFixed(3)} ms  p99 ${lat.added_p99_ms.toFixed(3)} ms   goal p99 <= 1 ms: ${lat.added_p99_ms <= 1 ? 'met' : 'NOT met'}`);
  console.log(`  fdatasync of one small append on the log's disk, alone: p50 ${floor.p50.toFixed(3)} ms  p99 ${floor.p99.toFixed(3)} ms (every answer waits for one; group commit shares it between the calls that arrive meanwhile)`);
  console.log(`  the service's histogram: ${(within1ms * 100).toFixed(1)}% of calls had <= 1 ms added by the gateway (parse, record, fsync, answer)`);

  // 2. Micro-batches/s to 8 ranks.
  const dp = 8;
  const groups = quick ? 16 : 64;
  const feed = await serve(['--engine', stub.url, '--data', join(data, 'feed'), '--group-size', '4', '--groups-per-step', '4', '--dp', String(dp), '--max-tokens', '256', '--window', '8']);
  const post = (path: string, body: unknown) => fetch(`${feed.url}${path}`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });
  for (let g = 0; g < groups; g++) {
    await Promise.all(Array.from({ length: 4 }, (_, k) => post('/buffer/write', {
      uid: `g${g}-${k}`, instance_id: `g${g}`, reward: k % 2, extra_info: {},
      messages: [{ role: 'system', content: 'You are a helpful agent. '.repeat(20) }, { role: 'user', content: `task ${g}: ${'details '.repeat(30)}` }, { role: 'assistant', content: `answer ${k} ${'words '.repeat(40)}` }],
    })));
  }
  const tf = performance.now();
  let pulled = 0;
  await Promise.all(Array.from({ length: dp }, async (_, rank) => {
    for (;;) {
      const r = await fetch(`${feed.url}/v1/batches/next?rank=${rank}&wait=2`);
      if (r.status !== 200) return;
      await r.arrayBuffer();
      await post(`/v1/batches/${r.headers.get('x-treepack-id')}/ack`, {});
      pulled++;
    }
  }));
  const feedSeconds = (performance.now() - tf) / 1000 - 2; // the last poll of each rank waits 2 s for nothing
  await feed.stop();
  report.feed = { dp, groups, micro_batches: pulled, micro_batches_per_s: pulled / feedSeconds };
  console.log(`trainer feed, dp = ${dp}: ${pulled} micro-batches from ${groups} groups of 4 in ${feedSeconds.toFixed(2)} s = ${(pulled / feedSeconds).toFixed(1)} micro-batches/s (packing each step included)`);

  // 3. Memory under backpressure.
  const bound = 8 << 20;
  const bp = await serve(['--engine', stub.url, '--data', join(data, 'bp'), '--max-pool-bytes', String(bound), '--group-size', '1']);
  let refused = 0, accepted = 0;
  const big = 'x'.repeat(16 << 10);
  for (let i = 0; i < 1200 && refused < 50; i++) {
    const r = await fetch(`${bp.url}/v1/chat/completions`, { method: 'POST', headers: { 'content-type': 'application/json', 'x-treepack-episode': `never-${i}` }, body: JSON.stringify({ model: 'm', messages: [{ role: 'user', content: big }] }) });
    await r.arrayBuffer();
    if (r.status === 429) refused++;
    else accepted++;
  }
  const rss = Number(readFileSync(`/proc/${bp.child.pid}/status`, 'utf8').match(/VmRSS:\s+(\d+)/)![1]) * 1024;
  await bp.stop();
  report.backpressure = { pool_bound_bytes: bound, accepted, refused_429: refused, service_rss_bytes: rss };
  console.log(`backpressure: pool bound ${bound >> 20} MiB, ${accepted} calls of 16 KiB accepted, then ${refused} answered 429; service RSS ${(rss / 2 ** 20).toFixed(0)} MiB`);
  console.log('Redis Streams pool (--redis): not measured here; its calls take the same path plus one Redis round trip on a group\'s first call and one on each finish');
} finally {
  await stub.close();
  rmSync(data, { recursive: true, force: true });
}
if (values.json) writeFileSync(values.json, JSON.stringify(report, null, 2));
