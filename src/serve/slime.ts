/**
 * The buffer side of slime's agent rollout (slime_plugins/rollout_buffer/buffer.py and
 * slime/rollout/agent_rollout.py), with slime's payloads:
 *  - `POST /start_rollout` takes slime's payload (`num_repeat_per_sample` sets the group size; the agents
 *    themselves run outside, through the gateway) and answers `{"message": "Rollout started"}`;
 *  - `POST /buffer/write` takes a producer's record `{uid, instance_id, messages, reward, extra_info}`;
 *  - `POST /get_rollout_data` answers `{success, message, data: {data: [records], meta_info}}` with whole
 *    finished groups only (as slime expects), taken by the service's scheduling policy; records carry `uid`,
 *    `instance_id`, `messages`, `reward`, `raw_reward` and `extra_info`, and `meta_info` slime's `total_samples`,
 *    `num_groups`, `avg_group_size`, `avg_reward` and `finished_groups`.
 * Episodes recorded by the gateway appear as records too: their messages are the last call's conversation with
 * its response. A read is logged before it is answered and is at most once, as in slime (there is no ack).
 */
import type { FastifyInstance } from 'fastify';
import { describeValue } from '../errors.js';
import { checkId, PoolError, recordDigest, type Episode } from './pool.js';
import type { Recorder } from './recorder.js';

/** What these routes use of the recording core. */
export type SlimeCore = Pick<Recorder, 'pool' | 'feed' | 'metrics' | 'shared' | 'commit' | 'admit' | 'opts'>;

type Obj = Record<string, unknown>;
const isObj = (v: unknown): v is Obj => typeof v === 'object' && v !== null && !Array.isArray(v);

function slimeRecord(ep: Episode): Obj {
  if (ep.direct) return { ...ep.direct, raw_reward: ep.direct.raw_reward ?? ep.reward };
  const last = ep.calls[ep.calls.length - 1];
  const sent = last?.output.message ? [...(last.request.messages ?? []), last.output.message] : (last?.request.messages ?? []);
  // OpenAI clients send a tool-calling turn with `content: null`, or without `content` (`model_dump(exclude_none=True)`);
  // slime's loss-mask generator and group checks read content as a string (`message["content"]`, `in`, `.strip()`),
  // so a record carries "" there, as slime's own gateway does.
  const messages = sent.map((m) => (isObj(m) && (m.content === null || m.content === undefined) ? { ...m, content: '' } : m));
  const extra: Obj = {
    ...(ep.metadata ?? {}),
    finish_reason: last?.output.finishReason ?? null,
    timestamp: (last?.time ?? 0) / 1000,
    calls: ep.calls.length,
  };
  if (ep.agents.size) extra.agents = [...ep.agents];
  return { uid: ep.id, instance_id: ep.group, messages, reward: ep.reward, raw_reward: ep.reward, extra_info: extra };
}

function checkRecord(b: unknown): { uid: string; instance_id: string; reward: number; record: Obj } {
  if (!isObj(b)) throw new PoolError(400, `request body: expected a record object, got ${describeValue(b)}`);
  for (const f of ['uid', 'instance_id'] as const) {
    if (!(typeof b[f] === 'string' && b[f] !== '') && !Number.isInteger(b[f]))
      throw new PoolError(400, `field "${f}": expected a string or integer id, got ${describeValue(b[f])}`);
  }
  if (!Array.isArray(b.messages) || b.messages.length < 2)
    throw new PoolError(
      400,
      `field "messages": expected the conversation (at least a prompt and the assistant's answer), got ${describeValue(b.messages)}`,
    );
  b.messages.forEach((m, i) => {
    if (!isObj(m) || typeof m.role !== 'string')
      throw new PoolError(400, `field "messages[${i}]": expected a message with a role, got ${describeValue(m)}`);
  });
  const last = b.messages[b.messages.length - 1] as Obj;
  if (last.role !== 'assistant')
    throw new PoolError(
      400,
      `field "messages[${b.messages.length - 1}].role": the last message is what the policy generated, expected "assistant", got ${describeValue(last.role)}`,
    );
  if (typeof b.reward !== 'number' || !Number.isFinite(b.reward))
    throw new PoolError(400, `field "reward": expected a finite number, got ${describeValue(b.reward)}`);
  if (b.extra_info !== undefined && !isObj(b.extra_info))
    throw new PoolError(400, `field "extra_info": expected an object, got ${describeValue(b.extra_info)}`);
  // The pool keys episodes and groups by string; the record goes back as written (slime's Sample.index is an int).
  const uid = String(b.uid);
  const instance = String(b.instance_id);
  checkId('field "uid"', uid);
  checkId('field "instance_id"', instance);
  return { uid, instance_id: instance, reward: b.reward, record: { ...b, extra_info: b.extra_info ?? {} } };
}

export function registerSlime(app: FastifyInstance, svc: SlimeCore): void {
  app.post('/start_rollout', async (req) => {
    const b = req.body;
    if (!isObj(b)) throw new PoolError(400, `request body: expected slime's start_rollout payload, got ${describeValue(b)}`);
    const n = Number(b.num_repeat_per_sample);
    if (!Number.isSafeInteger(n) || n < 1 || n > svc.opts.maxGroupSize) {
      throw new PoolError(
        400,
        `field "num_repeat_per_sample": expected an integer in 1..${svc.opts.maxGroupSize} (as a string or number; the service's --max-group-size), got ${describeValue(b.num_repeat_per_sample)}`,
      );
    }
    await svc.commit({ type: 'group-size', size: n });
    return { message: 'Rollout started' };
  });

  /**
   * A record joins its instance's group not yet read, or starts the instance's next round (every epoch writes each
   * instance again, with new uids): slime's buffer takes them all. A write resent with the same uid and record
   * (slime's producer tries twice) is answered as the first was; the same uid with another record is refused.
   */
  app.post('/buffer/write', async (req) => {
    const r = checkRecord(req.body);
    const answer = {
      success: true,
      message: 'Data has been successfully written to buffer',
      data: { data: [r.record], meta_info: 'write to buffer' },
    };
    const digest = recordDigest(r.record);
    if (svc.pool.episodes.get(r.uid)?.written === digest) return answer;
    svc.admit();
    // On the shared pool the round is chosen there, over every gateway's records (a resend through another gateway
    // finds its round, or that it was read); here, by this pool, with no await between choosing and committing, so
    // concurrent writes choose in order.
    const group = svc.shared
      ? await svc.shared.recordGroup(r.instance_id, r.uid, svc.pool.groupSize, digest)
      : svc.pool.recordGroup(r.instance_id);
    if (group === undefined) return answer;
    await svc.commit({ type: 'record', episode: r.uid, group, record: r.record, reward: r.reward, time: Date.now() });
    svc.metrics.episodes.inc();
    return answer;
  });

  app.post('/get_rollout_data', async (req) => {
    const b = (req.body ?? {}) as Obj;
    const max = b.batch_size === undefined || b.batch_size === null ? Infinity : Number(b.batch_size);
    if (!(max === Infinity || (Number.isSafeInteger(max) && max >= 1)))
      throw new PoolError(400, `field "batch_size": expected an integer >= 1, got ${describeValue(b.batch_size)}`);
    // batch_size counts samples in slime; whole groups only, so as many groups as fit (at least one).
    const groups = max === Infinity ? Number.MAX_SAFE_INTEGER : Math.max(1, Math.floor(max / svc.pool.groupSize));
    const data = await svc.feed.takeWhole(groups, (episodes) => episodes.map(slimeRecord));
    const records = data ?? [];
    const rewards = records.map((r) => r.reward as number);
    const numGroups = new Set(records.map((r) => r.instance_id)).size;
    const meta_info = {
      total_samples: records.length,
      num_groups: numGroups,
      avg_group_size: numGroups ? records.length / numGroups : 0,
      avg_reward: rewards.length ? rewards.reduce((a, x) => a + x, 0) / rewards.length : 0,
      finished_groups: [] as string[],
    };
    if (!records.length) return { success: false, message: 'No data available to read', data: { data: [], meta_info } };
    return { success: true, message: `Successfully read ${records.length} items`, data: { data: records, meta_info } };
  });
}
