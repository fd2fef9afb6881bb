/**
 * A chat call's messages checked before the engine sees them or anything is recorded, by the rules the packer
 * reads a record with (records/read.ts), so a call answered 200 is one the trainer can pack: roles the packer
 * knows (system, user, assistant, tool), `developer` as the served chat template renders it, content a string,
 * null or text parts (image parts are refused: the gateway does not record images), well-formed tool calls, and
 * the id a tool message answers. What fails is a 400 naming the message and field. What the template does with a
 * message only the packing step shows (docs/guides/service.md, "Poison records").
 */
import { describeValue, TreepackError } from '../errors.js';
import { parseRecords } from '../records/read.js';
import type { ChatEncoder } from '../tokenize/chat.js';
import { PoolError } from './pool.js';

type Obj = Record<string, unknown>;

/** The roles of the packer's chat records: each renders as a turn of its own (timeline/build.ts). */
const ROLES = new Set(['system', 'user', 'assistant', 'tool']);

/**
 * How `developer` (what current OpenAI SDKs send in place of system) is sent to an engine serving `encoder`'s
 * template: as it is where the template renders it, as `system` where the template renders only that (as the
 * Responses API maps it), refused (undefined) where it renders neither.
 */
const developerAs = new WeakMap<ChatEncoder, 'developer' | 'system' | undefined>();

function developerRole(encoder: ChatEncoder): 'developer' | 'system' | undefined {
  if (!developerAs.has(encoder)) {
    developerAs.set(encoder, encoder.rendersRole('developer') ? 'developer' : encoder.rendersRole('system') ? 'system' : undefined);
  }
  return developerAs.get(encoder);
}

/**
 * The messages of a chat call as they go to the engine and into the log (`developer` mapped as above), or a 400
 * naming the first message and field the packer would refuse.
 */
export function checkChatMessages(messages: readonly unknown[], tools: unknown, encoder: ChatEncoder): unknown[] {
  const developer = developerRole(encoder);
  const out = messages.map((m, i) => {
    const msg = m as Obj;
    if (msg.role === 'developer' && developer !== undefined) return developer === 'developer' ? m : { ...msg, role: 'system' };
    if (typeof msg.role !== 'string' || !ROLES.has(msg.role)) {
      const known = developer === undefined ? 'system, user, assistant or tool' : 'system, developer, user, assistant or tool';
      const why = `expected ${known} (the roles the served chat template renders as turns), got ${describeValue(msg.role)}`;
      throw new PoolError(400, `field "messages[${i}].role": ${why}`);
    }
    // The packer reads image parts (records/images.ts), but the gateway neither forwards them with the engine's
    // placeholder expansion nor records their bytes: a call with one would be packed from a log missing its images.
    if (Array.isArray(msg.content)) {
      const j = (msg.content as unknown[]).findIndex((p) => (p as Obj | null)?.type === 'image_url');
      if (j >= 0)
        throw new PoolError(
          400,
          `field "messages[${i}].content[${j}]": expected a text part {"type": "text", "text": string}, ` +
            'got a part of type "image_url" (the gateway does not record images)',
        );
    }
    if (msg.role === 'tool' && (typeof msg.tool_call_id !== 'string' || msg.tool_call_id === '')) {
      const why = `a tool message needs the id of the call it answers, got ${describeValue(msg.tool_call_id)}`;
      throw new PoolError(400, `field "messages[${i}].tool_call_id": ${why}`);
    }
    return m;
  });
  try {
    parseRecords({ messages: out, tools, response: { role: 'assistant', content: '' } }, { file: 'request', line: 1 });
  } catch (err) {
    if (err instanceof TreepackError && err.where.field !== undefined) {
      throw new PoolError(400, `field "${err.where.field}": ${err.detail}`);
    }
    throw err;
  }
  return out;
}
