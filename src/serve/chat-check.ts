/**
 * A chat call's messages checked before the engine sees them or anything is recorded, by the rules the packer
 * reads a record with (records/read.ts), so a call answered 200 is one the trainer can pack: roles the packer
 * knows (system, user, assistant, tool), `developer` as the served chat template renders it, content a string,
 * null, text parts and image parts (data URLs only: the gateway neither fetches a remote image nor reads a file, and
 * the served tokenizer must have an image processor that takes the image), well-formed tool calls, and the id a
 * tool message answers. What fails is a 400 naming the message and field; images over the call's bound a 413. What
 * the template does with a message only the packing step shows (docs/guides/service.md, "Poison records").
 */
import { describeValue, TreepackError } from '../errors.js';
import { parseRecords } from '../records/read.js';
import { dataUrlBytes, ImageInputError, loadImage } from '../records/images.js';
import type { ChatEncoder } from '../tokenize/chat.js';
import { ImageRefusedError, processImage } from '../tokenize/images.js';
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
export function checkChatMessages(messages: readonly unknown[], tools: unknown, encoder: ChatEncoder, maxImageBytes: number): unknown[] {
  const developer = developerRole(encoder);
  let imageBytes = 0;
  const out = messages.map((m, i) => {
    const msg = m as Obj;
    if (msg.role === 'developer' && developer !== undefined) return developer === 'developer' ? m : { ...msg, role: 'system' };
    if (typeof msg.role !== 'string' || !ROLES.has(msg.role)) {
      const known = developer === undefined ? 'system, user, assistant or tool' : 'system, developer, user, assistant or tool';
      const why = `expected ${known} (the roles the served chat template renders as turns), got ${describeValue(msg.role)}`;
      throw new PoolError(400, `field "messages[${i}].role": ${why}`);
    }
    if (Array.isArray(msg.content))
      (msg.content as unknown[]).forEach((p, j) => {
        if ((p as Obj | null)?.type === 'image_url')
          imageBytes += checkImage(p as Obj, `messages[${i}].content[${j}]`, encoder, maxImageBytes - imageBytes);
      });
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

/**
 * An image part's data URL decoded and taken by the served model's processor (what the packer will do with it, so
 * a call answered 200 packs); returns its size in bytes. `left`: the bytes the call's bound still allows.
 */
function checkImage(part: Obj, at: string, encoder: ChatEncoder, left: number): number {
  const field = `${at}.image_url.url`;
  const url = (part.image_url as Obj | null | undefined)?.url;
  const bad = (why: string) => new PoolError(400, `field "${field}": ${why}`);
  if (typeof url !== 'string') throw bad(`expected an image URL string, got ${describeValue(url)}`);
  const bytes = dataUrlBytes(url);
  if (bytes === undefined)
    throw bad(
      `expected a base64 data URL (data:image/png;base64,...), got ${JSON.stringify(url.slice(0, 60))}: ` +
        'the gateway never fetches an image or reads a file; send its bytes inline',
    );
  if (bytes.length > left)
    throw new PoolError(
      413,
      `field "${field}": the call's images take more than the service's --max-image-bytes (${bytes.length} bytes here, ${left} left)`,
    );
  const proc = encoder.tokenizer.imageProcessor;
  if (!proc)
    throw bad(`tokenizer ${encoder.tokenizer.name} has no image processor (preprocessor_config.json): the served model takes text only`);
  try {
    // decoded once per distinct data URL (loadImage's cache), which the record check below reads again
    processImage(loadImage(url, '.'), proc);
  } catch (e) {
    if (e instanceof ImageInputError) throw bad(e.message);
    if (e instanceof ImageRefusedError) throw bad(`the ${proc.family} image processor refuses the image: ${e.message}`);
    throw e;
  }
  return bytes.length;
}
