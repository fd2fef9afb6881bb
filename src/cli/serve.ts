/** `treepack serve`: flags in, a running service out (src/serve); stops cleanly on SIGINT/SIGTERM. */
import type { CollectorPolicy } from '../pack/schedule.js';
import { loadService } from '../serve/load.js';
import { resolveServiceOptions, type ServiceOptions } from '../serve/options.js';
import { TreepackError } from '../errors.js';
import { int, optionEntry } from '../packer/option-table.js';
import { flagValue, optionFlags, optionValue, packerOptions, parse, positiveInt, usageError, wrap } from './args.js';

/** The packer's options that serve takes as flags; its --dp is also the feed's ranks, so it is read apart. */
export const SERVE_PACKER_OPTIONS = (
  [
    'tokenizer',
    'backend',
    'budget.maxTokens',
    'budget.padMultiple',
    'budget.prefixCacheTokens',
    'advantages',
    'merge.timelineCompareLevel',
    'routeConflict',
  ] as const
).map(optionEntry);
export const DP = optionEntry('budget.dp');

export const SERVE_USAGE = `Usage: treepack serve --engine URL --data DIR --tokenizer DIR|NAME [options]

Puts treepack between agents, their inference engine and the trainer: a recording gateway (/v1/chat/completions,
/v1/completions, and the Responses and Messages APIs /v1/responses, /v1/messages, sent to the engine as chat
completions), a slime-compatible rollout buffer (/start_rollout, /buffer/write, /get_rollout_data), and a trainer
feed of packed micro-batches (GET /v1/batches/next, POST /v1/batches/{id}/ack).

Options:
  --engine URL            the engine's OpenAI base URL, e.g. http://127.0.0.1:8000/v1          [required]
  --data DIR              durable log directory (replayed on start)                            [required]
  --host H                bind address; anything but loopback needs --token      [default: 127.0.0.1]
  --port P                                                                          [default: 8400]
  --token T               bearer token required on every request (or env TREEPACK_SERVE_TOKEN)
  --engine-api-key K      sent to the engine as its bearer token
  --engine-timeout S      seconds before a call to the engine fails with 504          [default: 600]
  --group-size N          episodes per group (GRPO n); a group is finished with N finished episodes
                                                                                        [default: 1]
  --policy P              windowed-fifo, fifo (a window of 1) or async             [default: windowed-fifo]
  --window W              window of the windowed FIFO, in groups                         [default: 4]
  --groups-per-step G     groups packed into one trainer step                            [default: 1]
  --lease S               seconds before a micro-batch handed out and not acknowledged is handed out again
                                                                                       [default: 600]
  --idle-timeout S        abandon a group none of whose episodes called, finished or was abandoned for S
                          seconds: it trains with its finished episodes (0: never)    [default: 1800]
  --max-pool-bytes B      answer new calls 429 once B bytes of calls wait for the trainer [default: 1 GiB]
  --body-limit B          largest request body, bytes                                  [default: 32 MiB]
  --request-timeout S     seconds a client has to send a request's headers and body (not counting the
                          engine's answer); a slower one gets 408 and its socket is closed  [default: 60]
  --max-group-size N      the largest group size a finish's group_size or slime's num_repeat_per_sample
                          may set                                                     [default: 1024]
  --rate-limit N          requests per minute per client address (0: none)               [default: 0]
  --compact-bytes B       compact the durable log once it is B bytes and twice its last compacted size
                                                                                      [default: 64 MiB]
  --redis URL             share the pool and the trainer feed with other services through Redis Streams
                          (e.g. redis://127.0.0.1:6379); every service on it needs the same feed options
  --redis-allow-weak-durability
                          start even when Redis is not run with appendonly yes and appendfsync always
                          (a Redis crash may then lose acknowledged work), with a warning
  --record-routes         ask the engine for the experts it routed each token to (return_routed_experts,
                          for MoE routing replay; SGLang needs it, vLLM returns them when started with
                          --enable-return-routed-experts); routes an engine returns are recorded either way
  --route-shape L,K       layers and experts per token of routes sent as a flat array (SGLang)
  --max-route-bytes B     routes of one output larger than B bytes (int16) are not recorded
                                                                                      [default: 64 MiB]
  --max-image-bytes B     a chat call whose images (data URLs, decoded) take more than B bytes is refused 413
                                                                                      [default: 16 MiB]
Packing, as treepack pack (--timeline-compare-level defaults to token: each call trains in the context the
engine saw):
${wrap([...SERVE_PACKER_OPTIONS, DP].map((e) => `${e.flag} ${e.metavar}`).join(', '), 106)
  .map((l) => `  ${l}`)
  .join('\n')}
  -h, --help              this help`;

function policyOption(policy: string | undefined, window: number | undefined): CollectorPolicy {
  if (policy === undefined || policy === 'windowed-fifo') return { kind: 'windowed-fifo', window: window ?? 4 };
  if (window !== undefined) throw usageError(`--window applies to --policy windowed-fifo, not ${policy}`);
  if (policy === 'fifo') return { kind: 'windowed-fifo', window: 1 };
  if (policy === 'async') return { kind: 'async' };
  throw usageError(`Expected windowed-fifo, fifo or async for --policy but received ${JSON.stringify(policy)}`);
}

/** `--route-shape L,K`: two positive integers. */
function routeShape(v: string): [number, number] {
  const m = /^\s*(\d+)\s*,\s*(\d+)\s*$/.exec(v);
  if (!m) throw usageError(`Expected LAYERS,TOPK (two positive integers) for --route-shape but received ${JSON.stringify(v)}`);
  return [Number(m[1]), Number(m[2])];
}

/** The service's option names as the flags that set them: a usage error names what the user typed. */
const FLAG_OF: Record<string, string> = {
  engineUrl: '--engine',
  dataDir: '--data',
  token: '--token',
  redis: '--redis',
  dp: '--dp',
  'packer.budget': '--max-tokens',
  groupSize: '--group-size',
  groupsPerStep: '--groups-per-step',
  leaseMs: '--lease',
  engineTimeoutMs: '--engine-timeout',
  requestTimeoutMs: '--request-timeout',
  maxGroupSize: '--max-group-size',
  maxPoolBytes: '--max-pool-bytes',
  bodyLimit: '--body-limit',
  compactBytes: '--compact-bytes',
  idleTimeoutMs: '--idle-timeout',
  routeShape: '--route-shape',
  maxRouteBytes: '--max-route-bytes',
  maxImageBytes: '--max-image-bytes',
  ...Object.fromEntries(SERVE_PACKER_OPTIONS.map((e) => [e.option, e.flag])),
};

function checkOptions(options: ServiceOptions): void {
  try {
    optionValue(() => resolveServiceOptions(options));
  } catch (err) {
    if (!(err instanceof TreepackError) || err.code !== 'E_USAGE') throw err;
    throw usageError(
      err.detail.replace(/ for ([\w.]+) but received /, (m, name: string) => (FLAG_OF[name] ? ` for ${FLAG_OF[name]} but received ` : m)),
    );
  }
}

export async function serveCommand(argv: string[]): Promise<number> {
  const S = { type: 'string' } as const;
  const { values } = parse(
    argv,
    {
      engine: S,
      data: S,
      host: S,
      port: S,
      token: S,
      'engine-api-key': S,
      'engine-timeout': S,
      'group-size': S,
      policy: S,
      window: S,
      'groups-per-step': S,
      lease: S,
      'idle-timeout': S,
      'max-pool-bytes': S,
      'body-limit': S,
      'request-timeout': S,
      'max-group-size': S,
      'rate-limit': S,
      'compact-bytes': S,
      redis: S,
      'redis-allow-weak-durability': { type: 'boolean' },
      'record-routes': { type: 'boolean' },
      'route-shape': S,
      'max-route-bytes': S,
      'max-image-bytes': S,
      dp: S,
      ...optionFlags(SERVE_PACKER_OPTIONS),
    },
    SERVE_USAGE,
  );
  if (values.help) {
    console.log(SERVE_USAGE);
    return 0;
  }
  const str = (k: string) => values[k] as string | undefined;
  if (!str('engine') || !str('data')) throw usageError(`--engine URL and --data DIR are required\n\n${SERVE_USAGE}`);
  // The gateway tokenizes every call with it: another model's vocabulary would train silently wrong.
  if (!str('tokenizer'))
    throw usageError(`--tokenizer DIR|NAME is required: the engine's tokenizer directory, or a built-in by name (qwen3)\n\n${SERVE_USAGE}`);
  const packer = packerOptions(values, SERVE_PACKER_OPTIONS);
  const dp = str('dp') === undefined ? 1 : (flagValue(DP.value, DP.flag, str('dp')!) as number);
  if (dp > 1 && !packer.budget) throw usageError('--dp needs --max-tokens T (ranks come from the budgeted plan)');
  const rate = str('rate-limit');
  const weakDurability = values['redis-allow-weak-durability'] === true;
  if (weakDurability && str('redis') === undefined)
    throw usageError('--redis-allow-weak-durability applies to the shared pool: it needs --redis URL');
  const options: ServiceOptions = {
    engineUrl: str('engine')!,
    dataDir: str('data')!,
    host: str('host'),
    port: positiveInt('--port', str('port')),
    token: str('token') ?? process.env.TREEPACK_SERVE_TOKEN,
    engineApiKey: str('engine-api-key'),
    engineTimeoutMs: positiveInt('--engine-timeout', str('engine-timeout'), 600)! * 1000,
    groupSize: positiveInt('--group-size', str('group-size')),
    policy: policyOption(str('policy'), positiveInt('--window', str('window'))),
    groupsPerStep: positiveInt('--groups-per-step', str('groups-per-step')),
    dp,
    leaseMs: positiveInt('--lease', str('lease'), 600)! * 1000,
    idleTimeoutMs:
      (str('idle-timeout') === undefined ? 1800 : (flagValue(int(0), '--idle-timeout', str('idle-timeout')!) as number)) * 1000,
    maxPoolBytes: positiveInt('--max-pool-bytes', str('max-pool-bytes')),
    bodyLimit: positiveInt('--body-limit', str('body-limit')),
    requestTimeoutMs: positiveInt('--request-timeout', str('request-timeout'), 60)! * 1000,
    maxGroupSize: positiveInt('--max-group-size', str('max-group-size')),
    rateLimit: rate === undefined || rate === '0' ? 0 : positiveInt('--rate-limit', rate),
    redis: str('redis'),
    ...(weakDurability && { redisAllowWeakDurability: true }),
    compactBytes: positiveInt('--compact-bytes', str('compact-bytes')),
    ...(values['record-routes'] === true && { recordRoutes: true }),
    ...(str('route-shape') !== undefined && { routeShape: routeShape(str('route-shape')!) }),
    maxRouteBytes: positiveInt('--max-route-bytes', str('max-route-bytes')),
    maxImageBytes: positiveInt('--max-image-bytes', str('max-image-bytes')),
    packer: { ...packer, ...(packer.budget && { budget: { ...packer.budget, dp } }) },
  };
  checkOptions(options); // a bad combination is a usage error, found before starting
  const { startService } = await loadService();
  const { service, url } = await startService(options);
  const models = service.recorder.engineModels;
  console.error(
    `treepack serve: listening on ${url}, engine ${service.opts.engineUrl}${models ? ` (serving ${models.join(', ')})` : ''}, log ${service.opts.dataDir}${service.shared ? `, shared pool ${service.shared.url}` : ''}`,
  );
  await new Promise<void>((resolve) => {
    const stop = () => resolve();
    process.once('SIGINT', stop);
    process.once('SIGTERM', stop);
  });
  await service.close();
  return 0;
}
