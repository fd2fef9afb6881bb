/**
 * bench:serve's durable floor (bench/serve-floor.ts) is the baseline the gateway's added latency is read
 * against, so it must do the durable work it claims: every call and finish in its log, with the request sent and
 * the engine's answer, before it answers; and the answer is the engine's.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { ROOT, startScript, tempDir } from './helpers/serve.js';
import { startStubEngine, type StubEngine } from './helpers/stub-engine.js';

const startFloor = (args: string[]) => startScript(join(ROOT, 'bench/serve-floor.ts'), args);
const post = (url: string, body: string) => fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body });

describe('bench:serve floor proxy', { timeout: 30_000 }, () => {
  let stub: StubEngine;
  beforeAll(async () => {
    stub = await startStubEngine();
  });
  afterAll(async () => {
    await stub?.close();
  });

  it('logs each call (request and answer) and each finish durably, and answers what the engine answered', async () => {
    const log = join(tempDir('tp-floor-'), 'floor.jsonl');
    const floor = await startFloor([stub.url, log]);
    try {
      const bodies = [0, 1, 2].map((i) => JSON.stringify({ model: 'm', messages: [{ role: 'user', content: `q${i}` }] }));
      const answers: string[] = [];
      for (const b of bodies) {
        const r = await post(`${floor.url}/v1/chat/completions`, b);
        expect(r.status).toBe(200);
        answers.push(await r.text());
      }
      expect((await post(`${floor.url}/v1/episodes/e1/finish`, '{"reward":1}')).status).toBe(200);
      // Answered only after the write: the lines are there now, before the floor stops (O_DSYNC: on disk too).
      const lines = readFileSync(log, 'utf8')
        .trim()
        .split('\n')
        .map((l) => JSON.parse(l) as Record<string, string>);
      expect(lines.map((l) => l.type)).toEqual(['call', 'call', 'call', 'finish']);
      expect(lines.slice(0, 3).map((l) => l.request)).toEqual(bodies);
      expect(lines.slice(0, 3).map((l) => l.output)).toEqual(answers);
      expect(answers.map((a) => (JSON.parse(a) as { choices: { message: { content: string } }[] }).choices[0].message.content)).toEqual([
        'reply 0',
        'reply 1',
        'reply 2',
      ]);
      const writes = (await (await fetch(`${floor.url}/writes`)).json()) as number[];
      expect(writes.length).toBeGreaterThanOrEqual(1);
      expect(writes.length).toBeLessThanOrEqual(4);
      expect((await (await fetch(`${floor.url}/writes`)).json()) as number[]).toEqual([]);
    } finally {
      await floor.stop();
    }
  });

  it('without a log, proxies only', async () => {
    const floor = await startFloor([stub.url]);
    try {
      const r = await post(`${floor.url}/v1/chat/completions`, JSON.stringify({ model: 'm', messages: [{ role: 'user', content: 'q' }] }));
      expect(r.status).toBe(200);
      expect((await fetch(`${floor.url}/writes`).then((x) => x.json())) as number[]).toEqual([]);
    } finally {
      await floor.stop();
    }
  });
});
