/**
 * The service's Prometheus metrics, on a registry of its own so several services can live in one process. Two of
 * them watch the process rather than the traffic, because every answer waits for the one event loop: its delay
 * (how late a timer due at any moment ran, i.e. how long a request arriving then waited for the loop) and the
 * garbage collector's pauses. `close` stops both watchers.
 */
import { constants, createHistogram, performance, PerformanceObserver, type PerformanceEntry } from 'node:perf_hooks';
import { Counter, Gauge, Histogram, Registry } from 'prom-client';

/** how often the loop-delay timer is due (ms): short enough that a 1 ms stall is seen, cheap (a callback per ms) */
const LOOP_RESOLUTION_MS = 1;
const GC_KINDS: Record<number, string> = {
  [constants.NODE_PERFORMANCE_GC_MAJOR]: 'major',
  [constants.NODE_PERFORMANCE_GC_MINOR]: 'minor',
  [constants.NODE_PERFORMANCE_GC_INCREMENTAL]: 'incremental',
  [constants.NODE_PERFORMANCE_GC_WEAKCB]: 'weakcb',
};

export interface QueueDepth {
  openEpisodes: number;
  finishedGroups: number;
  pendingBytes: number;
  microBatchesReady: number;
  microBatchesLeased: number;
  /** age of the oldest group still waiting for episodes (0: none) */
  oldestOpenGroupSeconds: number;
}

export function createMetrics(depth: () => Promise<QueueDepth>) {
  const registry = new Registry();
  const calls = new Counter({
    name: 'treepack_calls_total',
    help: 'LLM calls proxied, by endpoint and outcome',
    labelNames: ['endpoint', 'outcome'],
    registers: [registry],
  });
  const episodes = new Counter({ name: 'treepack_episodes_finished_total', help: 'episodes finished', registers: [registry] });
  const microBatches = new Counter({
    name: 'treepack_micro_batches_total',
    help: 'micro-batches by event (packed, handed_out, reissued, acked)',
    labelNames: ['event'],
    registers: [registry],
  });
  const rejected = new Counter({
    name: 'treepack_rejected_total',
    help: 'requests refused, by reason',
    labelNames: ['reason'],
    registers: [registry],
  });
  const quarantined = new Counter({
    name: 'treepack_quarantined_total',
    help: 'finished episodes packed out of their step because their records fail to pack (GET /v1/quarantine)',
    registers: [registry],
  });
  const untokenized = new Counter({
    name: 'treepack_engine_untokenized_calls_total',
    help: 'calls the engine answered without token ids, by kind (chat, completion)',
    labelNames: ['kind'],
    registers: [registry],
  });
  const routesDropped = new Counter({
    name: 'treepack_engine_routes_dropped_total',
    help: 'outputs whose routed experts the engine returned but the gateway did not record, by reason (invalid, length, too_large, no_shape, untokenized)',
    labelNames: ['reason'],
    registers: [registry],
  });
  const prompts = new Counter({
    name: 'treepack_prompts_total',
    help: 'recorded calls by how their tokens were obtained (matched, drifted, rendered, skipped)',
    labelNames: ['tokens'],
    registers: [registry],
  });
  const latency = new Histogram({
    name: 'treepack_gateway_seconds',
    help: 'time the gateway adds to a call: everything but waiting for the engine (log fsync included)',
    labelNames: ['endpoint'],
    buckets: [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1],
    registers: [registry],
  });
  const logWrite = new Histogram({
    name: 'treepack_log_write_seconds',
    help: 'durable write (O_DSYNC) of one group commit of the log: every answer waits for the one holding its event',
    buckets: [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5],
    registers: [registry],
  });
  const engine = new Histogram({
    name: 'treepack_engine_seconds',
    help: 'engine time per call',
    labelNames: ['endpoint'],
    buckets: [0.001, 0.01, 0.1, 0.5, 1, 5, 30, 120],
    registers: [registry],
  });
  const staleness = new Histogram({
    name: 'treepack_staleness_steps',
    help: 'trainer steps between the policy that generated a micro-batch and the step that takes it',
    buckets: [0, 1, 2, 4, 8, 16, 64],
    registers: [registry],
  });
  const gauge = (name: string, help: string, key: keyof QueueDepth) =>
    new Gauge({
      name,
      help,
      registers: [registry],
      async collect() {
        this.set((await depth())[key]);
      },
    });
  gauge('treepack_open_episodes', 'episodes with calls and no finish', 'openEpisodes');
  gauge('treepack_finished_groups_waiting', 'finished groups not yet consumed', 'finishedGroups');
  gauge('treepack_pool_bytes', 'bytes of recorded calls held for groups not yet consumed', 'pendingBytes');
  gauge('treepack_micro_batches_ready', 'packed micro-batches not handed out', 'microBatchesReady');
  gauge('treepack_micro_batches_leased', 'micro-batches handed out and not acknowledged', 'microBatchesLeased');
  gauge(
    'treepack_oldest_open_group_seconds',
    'age of the oldest group waiting for its episodes (0: none); the idle timeout abandons groups idle that long',
    'oldestOpenGroupSeconds',
  );

  // A timer of its own, not monitorEventLoopDelay: that one forgets its last tick when reset, so a stall that
  // began less than a tick after a scrape went unrecorded.
  const loop = createHistogram();
  let lastTick = performance.now();
  const ticker = setInterval(() => {
    const now = performance.now();
    loop.record(Math.max(1, Math.round((now - lastTick - LOOP_RESOLUTION_MS) * 1e6)));
    lastTick = now;
  }, LOOP_RESOLUTION_MS).unref();
  new Gauge({
    name: 'treepack_event_loop_delay_seconds',
    help: `event-loop delay since the last scrape: how late a timer due every ${LOOP_RESOLUTION_MS} ms ran, by quantile (and "max"); reset at each scrape`,
    labelNames: ['quantile'],
    registers: [registry],
    collect() {
      // No samples yet reads as 0, not the histogram's NaN/huge sentinel values.
      const q = (p: number) => (loop.count > 0 ? loop.percentile(p) / 1e9 : 0);
      this.set({ quantile: '0.5' }, q(50));
      this.set({ quantile: '0.99' }, q(99));
      this.set({ quantile: '0.999' }, q(99.9));
      this.set({ quantile: 'max' }, loop.count > 0 ? loop.max / 1e9 : 0);
      loop.reset();
    },
  });
  const gc = new Histogram({
    name: 'treepack_gc_pause_seconds',
    help: 'garbage-collector pauses of the service process, by kind (major, minor, incremental, weakcb)',
    labelNames: ['kind'],
    buckets: [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1],
    registers: [registry],
  });
  const gcObserver = new PerformanceObserver((list) => {
    for (const e of list.getEntries() as (PerformanceEntry & { detail?: { kind?: number } })[]) {
      gc.observe({ kind: GC_KINDS[e.detail?.kind ?? -1] ?? 'other' }, e.duration / 1000);
    }
  });
  gcObserver.observe({ entryTypes: ['gc'] });
  const close = () => {
    clearInterval(ticker);
    gcObserver.disconnect();
  };
  const counters = { calls, episodes, microBatches, rejected, quarantined, untokenized, routesDropped, prompts };
  return { registry, ...counters, latency, logWrite, engine, staleness, close };
}

export type Metrics = ReturnType<typeof createMetrics>;
