/**
 * The service and its engine: the engine is checked as the service starts (it answers, with a model list), and a
 * clear warning says what is wrong otherwise; an engine that answers calls without token ids is warned about once
 * and counted, since those calls are then trained on the chat template's rendering of their text.
 */
import { createServer, type Server } from 'node:http';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { Service } from '../src/serve/service.js';
import { loadTokenizer } from '../src/tokenize/tokenizer.js';
import { freePort, tempDir } from './helpers/serve.js';
import { startStubEngine, type StubEngine } from './helpers/stub-engine.js';

const post = (url: string, body: unknown) =>
  fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });

/** An HTTP server answering every request with `status` and `body`. */
async function fixed(status: number, body: string): Promise<{ url: string; server: Server }> {
  const server = createServer((_req, res) => res.writeHead(status, { 'content-type': 'application/json' }).end(body));
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  return { url: `http://127.0.0.1:${(server.address() as { port: number }).port}/v1`, server };
}

describe('the engine behind the gateway', { timeout: 60_000 }, () => {
  let plain: StubEngine;
  let tokenized: StubEngine;
  const open: { close(): unknown }[] = [];
  beforeAll(async () => {
    plain = await startStubEngine();
    tokenized = await startStubEngine('ok', { tokenizer: await loadTokenizer('qwen3') });
  });
  afterEach(async () => {
    for (const s of open.splice(0)) await s.close();
  });
  afterAll(async () => {
    await plain?.close();
    await tokenized?.close();
  });

  async function start(engineUrl: string): Promise<{ svc: Service; base: string; warnings: string[] }> {
    const warnings: string[] = [];
    const svc = await Service.create({
      engineUrl,
      dataDir: tempDir('tp-engine-'),
      port: 0,
      packer: { tokenizer: 'qwen3' },
      warn: (m) => warnings.push(m),
    });
    open.push(svc);
    return { svc, base: await svc.listen(), warnings };
  }

  it('checked at start-up: its model list, or a warning saying what is wrong', async () => {
    const ok = await start(tokenized.url);
    expect(ok.warnings).toEqual([]);
    expect(ok.svc.recorder.engineModels).toEqual(['stub']);

    const nowhere = `http://127.0.0.1:${await freePort()}/v1`;
    const down = await start(nowhere);
    expect(down.svc.recorder.engineModels).toBeUndefined();
    expect(down.warnings).toEqual([
      `the engine at ${nowhere} is unreachable (GET ${nowhere}/models: ${down.warnings[0].match(/connect ECONNREFUSED [\d.:]+/)?.[0]}); calls answer 502 until it does`,
    ]);

    const wrongPath = await fixed(404, '{"detail":"Not Found"}');
    open.push({ close: () => wrongPath.server.close() });
    const notFound = await start(wrongPath.url);
    expect(notFound.warnings).toEqual([
      expect.stringMatching(/answered GET .*\/v1\/models with HTTP 404 \(is --engine its OpenAI base URL, ending in \/v1\?\)/),
    ]);

    const noList = await fixed(200, '{"models": []}');
    open.push({ close: () => noList.server.close() });
    expect((await start(noList.url)).warnings).toEqual([expect.stringMatching(/with no OpenAI model list/)]);
  });

  it('calls answered without token ids: warned once, counted by kind', async () => {
    const { base, warnings } = await start(plain.url);
    for (let i = 0; i < 2; i++) {
      expect(
        (await post(`${base}/episodes/e${i}/v1/chat/completions`, { model: 'm', messages: [{ role: 'user', content: 'hi' }] })).status,
      ).toBe(200);
    }
    expect((await post(`${base}/episodes/c/v1/completions`, { model: 'm', prompt: 'hi' })).status).toBe(200);
    expect(warnings).toEqual([
      expect.stringMatching(/answered a chat call without token ids .* treepack_engine_untokenized_calls_total counts such calls$/),
    ]);
    const metrics = await (await fetch(`${base}/metrics`)).text();
    expect(metrics).toContain('treepack_engine_untokenized_calls_total{kind="chat"} 2');
    expect(metrics).toContain('treepack_engine_untokenized_calls_total{kind="completion"} 1');

    const withIds = await start(tokenized.url);
    expect(
      (await post(`${withIds.base}/episodes/e/v1/chat/completions`, { model: 'm', messages: [{ role: 'user', content: 'hi' }] })).status,
    ).toBe(200);
    expect(withIds.warnings).toEqual([]);
  });
});
