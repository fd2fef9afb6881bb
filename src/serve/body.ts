/**
 * Request bodies as the service reads them: JSON only (another content type is refused with 415 before it is read),
 * valid UTF-8 (as `treepack pack` reads records: a replaced byte would silently change what is trained) and nested
 * at most MAX_DEPTH deep (a deeper body would overflow the gateway's own serialisation on its way to the engine).
 * Each refusal is a 400 naming the byte or the field, before anything is recorded or forwarded.
 */
import { isUtf8 } from 'node:buffer';
import type { FastifyInstance, FastifyRequest } from 'fastify';
import { firstInvalidUtf8 } from '../records/jsonl.js';
import { PoolError } from './pool.js';

/** The deepest nesting of objects and lists a body may have: far above any chat request or tool schema. */
export const MAX_DEPTH = 64;

/** The path of the first value nested deeper than `max` (e.g. `messages[0].content[0]`), or undefined. */
export function tooDeep(value: unknown, max = MAX_DEPTH): string | undefined {
  // Iterative: the walk must not overflow the stack on the very bodies it is there to refuse.
  const stack: [unknown, string, number][] = [[value, '', 0]];
  while (stack.length > 0) {
    const [v, path, depth] = stack.pop()!;
    if (v === null || typeof v !== 'object') continue;
    if (depth >= max) return path === '' ? '(the body)' : path;
    if (Array.isArray(v)) v.forEach((x, i) => stack.push([x, `${path}[${i}]`, depth + 1]));
    else for (const [k, x] of Object.entries(v)) stack.push([x, path === '' ? k : `${path}.${k}`, depth + 1]);
  }
  return undefined;
}

/**
 * Makes the service's only body parser Fastify's JSON parser (its prototype-poisoning checks included) behind a
 * UTF-8 check, with the nesting checked after: a body of another content type is refused with 415.
 */
export function registerBodyParser(app: FastifyInstance): void {
  type Parse = (req: FastifyRequest, body: string, done: (err: Error | null, body?: unknown) => void) => void;
  const json = app.getDefaultJsonParser('error', 'error') as Parse;
  app.removeAllContentTypeParsers();
  // application/json, and any application/...+json, with or without parameters (charset)
  app.addContentTypeParser(/^application\/(?:[\w.+-]+\+)?json(?:;|$)/, { parseAs: 'buffer' }, (req: FastifyRequest, raw: Buffer, done) => {
    if (!isUtf8(raw)) {
      const at = firstInvalidUtf8(raw);
      const why = `request body: invalid UTF-8 at byte ${at}; send it as UTF-8 (the service records text as sent, it does not replace bad bytes)`;
      return done(new PoolError(400, why), undefined);
    }
    json(req, raw.toString('utf8'), (err, body) => {
      const deep = err ? undefined : tooDeep(body);
      if (deep !== undefined)
        return done(new PoolError(400, `field "${deep}": nested more than ${MAX_DEPTH} levels deep (lists and objects)`), undefined);
      done(err, body);
    });
  });
}
