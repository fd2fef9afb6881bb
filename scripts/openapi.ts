/**
 * The OpenAPI 3.1 document of `treepack serve` (docs/reference/openapi.json), written by `npm run gen:docs`
 * (scripts/gen-docs.ts). test/reference-docs.test.ts checks that its paths are exactly the routes the service
 * registers and that the errors it documents come back in its error shape: a route added to src/serve gets its
 * entry here, else that test names it.
 */
type Schema = Record<string, unknown>;

const ref = (n: string): Schema => ({ $ref: `#/components/schemas/${n}` });
const err = (desc: string): Schema => ({ description: desc, content: { 'application/json': { schema: ref('Error') } } });
const json = (desc: string, schema: Schema): Schema => ({ description: desc, content: { 'application/json': { schema } } });
const body = (schema: Schema, required = true): Schema => ({ required, content: { 'application/json': { schema } } });
const pathParam = (name: string, desc: string): Schema => ({
  name,
  in: 'path',
  required: true,
  description: desc,
  schema: { type: 'string', maxLength: 100 },
});
const obj = (properties: Record<string, Schema>, required = Object.keys(properties)): Schema => ({ type: 'object', properties, required });
const common = {
  '401': { $ref: '#/components/responses/Unauthorized' },
  '403': { $ref: '#/components/responses/Forbidden' },
  '429': { $ref: '#/components/responses/TooManyRequests' },
  '503': { $ref: '#/components/responses/Stopped' },
};
const str: Schema = { type: 'string' };
const int: Schema = { type: 'integer' };
const num: Schema = { type: 'number' };
const bool: Schema = { type: 'boolean' };
const nullable = (s: Schema): Schema => ({ oneOf: [s, { type: 'null' }] });

const gatewayHeaders = [
  {
    name: 'x-treepack-episode',
    in: 'header',
    description: 'the episode this call belongs to, where the URL and the API key do not say it',
    schema: str,
  },
  {
    name: 'x-treepack-group',
    in: 'header',
    description: 'the group (GRPO prompt) of the episode; default: the episode is its own group',
    schema: str,
  },
  { name: 'x-treepack-agent', in: 'header', description: 'the agent making the call, in a multi-agent episode', schema: str },
  {
    name: 'x-treepack-policy-version',
    in: 'header',
    description: "the trainer version of the weights the engine serves; default: the feed's current trainer_version",
    schema: { type: 'integer', minimum: 0 },
  },
  {
    name: 'Idempotency-Key',
    in: 'header',
    description:
      'a retry with the same key and body is answered with the first answer, byte for byte, and recorded once; the same key with another body is 422',
    schema: { type: 'string', maxLength: 256 },
  },
];
const anthropicErr = (desc: string): Schema => ({ description: desc, content: { 'application/json': { schema: ref('AnthropicError') } } });
const engineErrors = {
  '400': err('a field of the request is invalid (named in the message), the body is not valid UTF-8 or nests more than 64 deep'),
  '409': err('the episode is finished or abandoned, or its group is full, consumed or closed'),
  '415': err('the body is not JSON'),
  '422': err('the Idempotency-Key was used in this episode for another request body'),
  '502': err('the engine is unreachable, cut its answer off, or answered what the gateway cannot read'),
  '504': err('the engine did not answer within --engine-timeout'),
};

// /v1/messages answers every error in the Anthropic Messages API's shape, which its clients read.
const messagesErrors = {
  '400': anthropicErr('a field of the request is invalid or unsupported (named in the message)'),
  '401': anthropicErr('no API key, or a wrong one (x-api-key or Authorization: Bearer)'),
  '403': anthropicErr('a scoped key used outside its episode'),
  '409': anthropicErr('the episode is finished or abandoned, its group full, consumed or closed, or it is recorded by another gateway'),
  '429': anthropicErr('rate limited, or the pool is full'),
  '502': anthropicErr('the engine is unreachable or answered what the gateway cannot read'),
  '503': anthropicErr('the service stopped writing, or the shared pool is unreachable'),
  '504': anthropicErr('the engine did not answer within --engine-timeout'),
};

// A token count is no call: it records nothing and never reaches the engine, so only these can refuse it.
const countErrors = {
  '400': messagesErrors['400'],
  '401': messagesErrors['401'],
  '403': messagesErrors['403'],
  '429': anthropicErr('rate limited (--rate-limit)'),
};

/**
 * The gateway's operations, each served under three base URLs: /v1, /episodes/{episode}/v1 and
 * /groups/{group}/episodes/{episode}/v1 (src/serve/gateway.ts registers each for every prefix). A gateway route added
 * to the service is one more entry here.
 */
const GATEWAY_OPERATIONS: {
  path: string;
  method: 'get' | 'post';
  id: string;
  summary: string;
  body?: Schema;
  ok: string;
  okSchema?: Schema;
  errors: Record<string, Schema>;
  common?: Record<string, Schema>;
}[] = [
  {
    path: '/v1/chat/completions',
    method: 'post',
    id: 'chat',
    summary: "OpenAI chat completion, forwarded to the engine and recorded (with the engine's token ids and logprobs)",
    body: ref('ChatCompletionRequest'),
    ok: "the engine's answer, unchanged (a text/event-stream when stream is true)",
    errors: { ...engineErrors, '413': err("the call's images (decoded from their data URLs) take more than --max-image-bytes") },
  },
  {
    path: '/v1/completions',
    method: 'post',
    id: 'completion',
    summary: 'OpenAI text completion, forwarded and recorded',
    body: ref('CompletionRequest'),
    ok: "the engine's answer, unchanged",
    errors: engineErrors,
  },
  {
    path: '/v1/responses',
    method: 'post',
    id: 'responses',
    summary:
      "OpenAI Responses API, translated to the engine's chat completions and recorded as the equivalent chat call (docs/guides/agent-apis.md)",
    body: ref('ResponsesRequest'),
    ok: 'a Responses API response object (a text/event-stream of its events when stream is true)',
    errors: engineErrors,
  },
  {
    path: '/v1/messages',
    method: 'post',
    id: 'messages',
    summary:
      "Anthropic Messages API, translated to the engine's chat completions and recorded as the equivalent chat call; the key may come as x-api-key (docs/guides/agent-apis.md)",
    body: ref('MessagesRequest'),
    ok: 'an Anthropic message (a text/event-stream of its events when stream is true)',
    errors: messagesErrors,
  },
  {
    path: '/v1/messages/count_tokens',
    method: 'post',
    id: 'countTokens',
    summary:
      "Anthropic Messages API token count: the prompt tokens the engine gets for the equivalent /v1/messages call (its chat messages and tools through the service's chat template, with the generation prompt, and its tokenizer); not a call: nothing is recorded, no episode opened, the engine not asked (docs/guides/agent-apis.md)",
    body: ref('CountTokensRequest'),
    ok: "the count, in the Messages API's shape",
    okSchema: obj({ input_tokens: int }),
    errors: countErrors,
    common: {},
  },
  {
    path: '/v1/models',
    method: 'get',
    id: 'models',
    summary: "the engine's model list, relayed",
    ok: "the engine's answer, status and body unchanged",
    errors: { '502': engineErrors['502'], '504': engineErrors['504'] },
  },
];

/** The gateway's paths under one base URL: `prefix` and its path parameters, `suffix` of the operation ids. */
function gateway(prefix: string, params: Schema[], suffix: string): Record<string, Schema> {
  return Object.fromEntries(
    GATEWAY_OPERATIONS.map((op) => [
      `${prefix}${op.path}`,
      {
        [op.method]: {
          tags: ['gateway'],
          operationId: op.id + suffix,
          summary: op.summary,
          parameters: op.method === 'post' ? [...params, ...gatewayHeaders] : params,
          ...(op.body && { requestBody: body(op.body) }),
          responses: { '200': json(op.ok, op.okSchema ?? { type: 'object' }), ...(op.common ?? common), ...op.errors },
          'x-treepack-scoped': true,
        },
      },
    ]),
  );
}
const ep = pathParam('episode', 'episode id'),
  gp = pathParam('group', 'group id');

const groupAnswer = { group: str, group_finished: bool, group_episodes: nullable(int), group_size: int };
const doc: Schema = {
  openapi: '3.1.0',
  info: {
    title: 'treepack serve',
    version: '1',
    description:
      'The HTTP API of `treepack serve`: an OpenAI-compatible recording gateway in front of an inference engine, episodes, a slime-compatible rollout buffer and the trainer feed of packed micro-batches. Every error is `{"error": {"message", "type", "code"}}` (components/schemas/Error). Every route except /healthz needs `Authorization: Bearer <token>` when the service runs with --token; an episode\'s API key (POST /v1/episodes) opens only the routes marked x-treepack-scoped, for its own episode. docs/reference/http.md explains the flows; test/reference-docs.test.ts checks that these paths are exactly the routes the service registers.',
    license: { name: 'MIT', identifier: 'MIT' },
  },
  servers: [{ url: 'http://127.0.0.1:8400', description: 'the default --host and --port' }],
  security: [{}, { bearer: [] }],
  tags: [
    {
      name: 'gateway',
      description:
        'OpenAI-compatible routes agents call; each call is recorded under its episode. Three base URLs: /v1, /episodes/{episode}/v1, /groups/{group}/episodes/{episode}/v1.',
    },
    { name: 'episodes', description: 'episode keys, state, rewards' },
    { name: 'slime', description: "slime's rollout buffer protocol (slime/ray/rollout_data_source, buffer server)" },
    { name: 'trainer', description: 'the trainer feed: packed micro-batches in the format of format.md' },
    { name: 'operations', description: 'health and metrics' },
  ],
  paths: {
    ...gateway('', [], ''),
    ...gateway('/episodes/{episode}', [ep], 'InEpisode'),
    ...gateway('/groups/{group}/episodes/{episode}', [gp, ep], 'InGroup'),
    '/v1/episodes': {
      post: {
        tags: ['episodes'],
        operationId: 'createEpisodeKey',
        summary: "a scoped API key for one episode (and agent, group): the agent's only configuration",
        requestBody: body(obj({ episode_id: str, agent: str, group: str }, []), false),
        responses: {
          '200': json(
            'the key; the log keeps only its hash',
            obj({ episode_id: str, agent: nullable(str), group: nullable(str), api_key: str }),
          ),
          '400': err('a field is not a non-empty string'),
          ...common,
        },
      },
    },
    '/v1/episodes/{id}': {
      get: {
        tags: ['episodes'],
        operationId: 'getEpisode',
        summary: "an episode's state",
        parameters: [pathParam('id', 'episode id')],
        responses: {
          '200': json(
            'the episode',
            obj({
              episode_id: str,
              group: str,
              agents: { type: 'array', items: str },
              finished: bool,
              abandoned: nullable(str),
              reward: nullable(num),
              metadata: nullable({ type: 'object' }),
              calls: int,
            }),
          ),
          '404': err('unknown episode'),
          ...common,
        },
      },
    },
    '/v1/episodes/{id}/records': {
      get: {
        tags: ['episodes'],
        operationId: 'getEpisodeRecords',
        summary: 'the episode as the JSONL records the trainer feed packs (what treepack pack would read for it)',
        parameters: [pathParam('id', 'episode id')],
        responses: {
          '200': { description: 'one record per line', content: { 'application/x-ndjson': { schema: str } } },
          '404': err('unknown episode'),
          '410': err('the episode was consumed or shipped to the shared pool; its records are in the log only'),
          ...common,
        },
      },
    },
    '/v1/episodes/{id}/finish': {
      post: {
        tags: ['episodes'],
        operationId: 'finishEpisode',
        summary:
          'ends an episode with its reward; a retry with the same reward and metadata is answered as the first; an episode with no call is abandoned',
        parameters: [pathParam('id', 'episode id')],
        requestBody: body(
          obj({ reward: num, metadata: nullable({ type: 'object' }), group_size: nullable({ type: 'integer', minimum: 1 }) }, ['reward']),
        ),
        responses: {
          '200': json("the episode's group", obj({ episode_id: str, ...groupAnswer, abandoned: bool })),
          '400': err('reward, metadata or group_size invalid (group_size above --max-group-size)'),
          '409': err('the episode was abandoned or finished with another reward'),
          ...common,
        },
        'x-treepack-scoped': true,
      },
    },
    '/v1/episodes/{id}/abandon': {
      post: {
        tags: ['episodes'],
        operationId: 'abandonEpisode',
        summary: 'gives up an episode: it is not trained, and counts toward its group as if finished',
        parameters: [pathParam('id', 'episode id')],
        requestBody: body(obj({ group: str }, []), false),
        responses: {
          '200': json("the episode's group", obj({ episode_id: str, ...groupAnswer, abandoned: bool })),
          '400': err('group is not a non-empty string'),
          '409': err('the episode is already finished'),
          ...common,
        },
        'x-treepack-scoped': true,
      },
    },
    '/v1/groups/{id}/abandon': {
      post: {
        tags: ['episodes'],
        operationId: 'abandonGroup',
        summary: 'gives up a group: its unfinished episodes are abandoned and it trains with the finished ones',
        parameters: [pathParam('id', 'group id')],
        responses: {
          '200': json('what the group had', obj({ group: str, abandoned: bool, episodes_finished: int, episodes_abandoned: int })),
          '404': err('unknown group'),
          ...common,
        },
      },
    },
    '/start_rollout': {
      post: {
        tags: ['slime'],
        operationId: 'slimeStartRollout',
        summary: "slime's start of a rollout: sets the group size",
        requestBody: body({
          type: 'object',
          properties: { num_repeat_per_sample: { oneOf: [int, str] } },
          required: ['num_repeat_per_sample'],
        }),
        responses: { '200': json('started', obj({ message: str })), '400': err('num_repeat_per_sample is not an integer >= 1'), ...common },
      },
    },
    '/buffer/write': {
      post: {
        tags: ['slime'],
        operationId: 'slimeBufferWrite',
        summary: "one finished sample (a chat ending with the assistant's answer, with its reward)",
        requestBody: body(ref('SlimeRecord')),
        responses: {
          '200': json('written', obj({ success: bool, message: str, data: { type: 'object' } })),
          '400': err('a field of the record is invalid (named)'),
          '409': err('the uid was already written'),
          ...common,
        },
      },
    },
    '/get_rollout_data': {
      post: {
        tags: ['slime'],
        operationId: 'slimeGetRolloutData',
        summary: 'whole groups of finished samples, as written (batch_size counts samples; at least one group)',
        requestBody: body(obj({ batch_size: nullable({ type: 'integer', minimum: 1 }) }, []), false),
        responses: {
          '200': json(
            'success false with an empty list when none is ready',
            obj({
              success: bool,
              message: str,
              data: obj({
                data: { type: 'array', items: ref('SlimeRecord') },
                meta_info: obj({
                  total_samples: int,
                  num_groups: int,
                  avg_group_size: num,
                  avg_reward: num,
                  finished_groups: { type: 'array', items: str },
                }),
              }),
            }),
          ),
          '400': err('batch_size is not an integer >= 1'),
          ...common,
        },
      },
    },
    '/v1/batches/next': {
      get: {
        tags: ['trainer'],
        operationId: 'nextBatch',
        summary: 'the next packed micro-batch for a rank: the bytes of a micro-batch file (format.md)',
        parameters: [
          { name: 'rank', in: 'query', description: 'data-parallel rank, 0..dp-1 (default 0)', schema: { type: 'integer', minimum: 0 } },
          {
            name: 'dp',
            in: 'query',
            description: "the trainer's rank count; refused unless it equals the service's --dp",
            schema: { type: 'integer', minimum: 1 },
          },
          {
            name: 'wait',
            in: 'query',
            description: 'seconds to wait for one (long poll), 0..300 (default 0)',
            schema: { type: 'number', minimum: 0, maximum: 300 },
          },
          {
            name: 'client',
            in: 'query',
            description:
              "the trainer process asking (treepack.client.FeedClient sends a random id): a step plan's micro-batches of a rank go to one client, in plan order, until their lease runs out",
            schema: { type: 'string', pattern: '^[\\w.-]{1,128}$' },
          },
        ],
        responses: {
          '200': {
            description:
              'a micro-batch file (safetensors); acknowledge it with POST /v1/batches/{id}/ack after the optimizer step, or it is handed out again after --lease seconds',
            headers: {
              'x-treepack-id': { description: 'its id, for the ack', schema: str },
              'x-treepack-entry': { description: 'its manifest entry (format.md, micro_batches entries) as JSON', schema: str },
            },
            content: { 'application/octet-stream': { schema: { type: 'string', contentMediaType: 'application/octet-stream' } } },
          },
          '204': { description: 'none ready within wait', headers: { 'retry-after': { schema: str } } },
          '400': err('rank, dp, wait or client out of range'),
          ...common,
        },
      },
    },
    '/v1/batches/{id}/ack': {
      post: {
        tags: ['trainer'],
        operationId: 'ackBatch',
        summary: 'acknowledges a micro-batch after the optimizer step that used it',
        parameters: [pathParam('id', 'micro-batch id (x-treepack-id)')],
        responses: {
          '200': json(
            'its step; acknowledged before (a retried ack): repeated, and nothing changes',
            obj({ id: str, step: int, step_done: bool, trainer_version: int, repeated: bool }),
          ),
          '404': err('unknown micro-batch id'),
          '409': err('not handed out'),
          ...common,
        },
      },
    },
    '/v1/feed': {
      get: {
        tags: ['trainer'],
        operationId: 'getFeed',
        summary: "the feed's state",
        responses: {
          '200': json(
            'the feed',
            obj({
              policy: { type: 'object' },
              head: int,
              trainer_version: int,
              micro_batches_ready: int,
              micro_batches_leased: int,
              prompts: { type: 'object' },
              pack_errors: { type: 'array', items: {} },
              quarantined: int,
              quarantine: { type: 'array', items: obj({ step: int, episode: str, group: str, reason: str }) },
            }),
          ),
          ...common,
        },
      },
    },
    '/v1/quarantine': {
      get: {
        tags: ['trainer'],
        operationId: 'getQuarantine',
        summary:
          'the episodes packed out of their steps because their records fail to pack (the rest of each step was trained), newest last, with the records that reproduce the reason',
        parameters: [
          {
            name: 'limit',
            in: 'query',
            description: 'the newest entries to return (default 100)',
            schema: { type: 'integer', minimum: 1, maximum: 1000 },
          },
        ],
        responses: {
          '200': json(
            'the entries',
            obj({
              quarantined: {
                type: 'array',
                items: obj(
                  {
                    step: int,
                    time: int,
                    episode: str,
                    group: str,
                    reason: str,
                    records: { type: 'array', items: { type: 'object' } },
                    calls: { type: 'array', items: { type: 'object' } },
                  },
                  ['step', 'time', 'episode', 'group', 'reason'],
                ),
              },
            }),
          ),
          '400': err('limit out of range'),
          ...common,
        },
      },
    },
    '/v1/feed/flush': {
      post: {
        tags: ['trainer'],
        operationId: 'flushFeed',
        summary: 'the producers are done with the groups numbered so far: those may form steps smaller than --groups-per-step',
        responses: { '200': json('flushing', obj({ flushing: bool, flush_below: int })), ...common },
      },
    },
    '/healthz': {
      get: {
        tags: ['operations'],
        operationId: 'health',
        summary: 'liveness and readiness; never needs a token, never rate limited',
        security: [{}],
        responses: {
          '200': json('healthy', ref('Health')),
          '503': json("stopped writing (broken) or the shared pool's Redis is not connected", ref('Health')),
        },
      },
    },
    '/metrics': {
      get: {
        tags: ['operations'],
        operationId: 'metrics',
        summary: 'Prometheus metrics',
        responses: { '200': { description: 'Prometheus text exposition format', content: { 'text/plain': { schema: str } } }, ...common },
      },
    },
  },
  components: {
    securitySchemes: {
      bearer: {
        type: 'http',
        scheme: 'bearer',
        description: "the service's --token (TREEPACK_SERVE_TOKEN), or an episode's api_key for its own scoped routes",
      },
    },
    responses: {
      Unauthorized: err('missing or wrong bearer token (the service runs with --token)'),
      Forbidden: err("an episode's API key used outside its own episode's scoped routes"),
      TooManyRequests: {
        description: 'the rollout pool is full (--max-pool-bytes) or the client is over --rate-limit; retry after retry-after seconds',
        headers: { 'retry-after': { schema: str } },
        content: { 'application/json': { schema: ref('Error') } },
      },
      Stopped: err('the service stopped writing after a failed log write (see /healthz)'),
    },
    schemas: {
      Error: {
        type: 'object',
        required: ['error'],
        additionalProperties: false,
        description: "Every error the service answers itself (the gateway relays an engine's own 4xx answers unchanged).",
        properties: {
          error: {
            type: 'object',
            required: ['message', 'type', 'code'],
            additionalProperties: false,
            properties: {
              message: { type: 'string', description: 'what is wrong, naming the field, header or parameter' },
              type: {
                type: 'string',
                enum: ['invalid_request_error', 'authentication_error', 'rate_limit_error', 'engine_error', 'server_error'],
              },
              code: {
                type: ['string', 'null'],
                description:
                  'a TreepackError code (errors.md), not_found for an unknown route, a Fastify code (FST_ERR_*) for a refusal before routing, else null',
              },
            },
          },
        },
      },
      Health: obj({
        ok: bool,
        broken: nullable(str),
        shared_pool: nullable(obj({ url: str, connected: bool, status: str, last_error: nullable(str) })),
        trainer_version: int,
        pool_bytes: int,
        pack_errors: int,
      }),
      ChatCompletionRequest: {
        type: 'object',
        required: ['messages'],
        description: 'OpenAI chat completion request; other fields go to the engine unchanged',
        properties: {
          messages: {
            type: 'array',
            minItems: 1,
            description: 'content: a string, null, or text and image_url parts (images as base64 data URLs only)',
            items: { type: 'object', required: ['role'], properties: { role: str } },
          },
          tools: nullable({ type: 'array' }),
          stream: nullable(bool),
          n: nullable({
            type: 'integer',
            minimum: 1,
            maximum: 128,
            description: 'choices; each is recorded as a sibling branch of the call',
          }),
        },
      },
      CompletionRequest: {
        type: 'object',
        required: ['prompt'],
        description: 'OpenAI completion request with one prompt string; other fields go to the engine unchanged',
        properties: { prompt: str, stream: nullable(bool), n: nullable({ type: 'integer', minimum: 1, maximum: 128 }) },
      },
      ResponsesRequest: {
        type: 'object',
        required: ['input'],
        description:
          'OpenAI Responses API request: input (a string or message and function-call items), instructions, function tools; previous_response_id, conversation, item references, built-in tools and non-text content are refused (400 naming the field)',
        properties: {
          input: { oneOf: [str, { type: 'array' }] },
          instructions: nullable(str),
          tools: nullable({ type: 'array' }),
          stream: nullable(bool),
        },
      },
      MessagesRequest: {
        type: 'object',
        required: ['messages', 'max_tokens'],
        description:
          'Anthropic Messages API request: system, messages with text, tool_use and tool_result blocks, custom tools; server tools, thinking budgets, MCP and non-text content are refused (400 naming the field)',
        properties: {
          system: { oneOf: [str, { type: 'array' }] },
          messages: { type: 'array', minItems: 1 },
          max_tokens: int,
          tools: nullable({ type: 'array' }),
          stream: nullable(bool),
        },
      },
      CountTokensRequest: {
        type: 'object',
        required: ['messages'],
        description:
          "A Messages API request as count_tokens takes it (max_tokens and stream not needed), translated and refused as /v1/messages translates and refuses it; chat_template_kwargs (the engine's template variables) are rendered with; chat_template, add_generation_prompt and continue_final_message are refused (400 naming the field)",
        properties: {
          system: { oneOf: [str, { type: 'array' }] },
          messages: { type: 'array', minItems: 1 },
          tools: nullable({ type: 'array' }),
          tool_choice: nullable({ type: 'object' }),
          chat_template_kwargs: nullable({ type: 'object' }),
        },
      },
      AnthropicError: {
        type: 'object',
        required: ['type', 'error'],
        description: "An error of /v1/messages and /v1/messages/count_tokens, in the Anthropic Messages API's shape",
        properties: { type: { const: 'error' }, error: obj({ type: str, message: str }) },
      },
      SlimeRecord: {
        type: 'object',
        required: ['uid', 'instance_id', 'messages', 'reward'],
        description: "slime's sample: uid is the episode, instance_id the group; the record reads back as written",
        properties: {
          uid: { oneOf: [str, int] },
          instance_id: { oneOf: [str, int] },
          messages: { type: 'array', minItems: 1, items: { type: 'object', required: ['role'] } },
          reward: num,
          extra_info: { type: 'object' },
        },
      },
    },
  },
};
export const renderOpenApi = (): string => JSON.stringify(doc, null, 2) + '\n';
