/**
 * A stub OpenAI-compatible engine for the service's error, durability and latency tests (and the bench): answers
 * at once with a numbered reply, or misbehaves on purpose. Replies carry no token ids: the gateway then renders
 * with the chat template.
 */
import { createServer, type Server } from 'node:http';

export type StubMode = 'ok' | 'garbage' | 'no-choices' | 'hang' | 'error-500' | 'bad-logprobs' | 'stall-stream';

export interface StubEngine {
  url: string;
  server: Server;
  calls: number;
  mode: StubMode;
  /** when set, requests must carry it as their bearer token (401 otherwise) */
  apiKey?: string;
  close: () => Promise<void>;
}

export async function startStubEngine(mode: StubMode = 'ok'): Promise<StubEngine> {
  const stub = { calls: 0, mode } as StubEngine;
  const server = createServer((req, res) => {
    let body = '';
    req.on('data', (d: Buffer) => (body += d.toString()));
    req.on('end', () => {
      const n = stub.calls++;
      const send = (code: number, text: string, type = 'application/json') => {
        res.writeHead(code, { 'content-type': type, 'content-length': Buffer.byteLength(text) });
        res.end(text);
      };
      if (stub.apiKey !== undefined && req.headers.authorization !== `Bearer ${stub.apiKey}`) return send(401, JSON.stringify({ error: { message: 'bad engine key' } }));
      if (req.method === 'GET' && req.url === '/v1/models') return send(200, JSON.stringify({ object: 'list', data: [{ id: 'stub', object: 'model' }] }));
      if (stub.mode === 'hang') return; // never answers
      if (stub.mode === 'garbage') return send(200, '<html>oops</html>', 'text/html');
      if (stub.mode === 'error-500') return send(500, JSON.stringify({ error: { message: 'engine overloaded' } }));
      if (stub.mode === 'no-choices') return send(200, JSON.stringify({ id: 'x', choices: [] }));
      const req0 = JSON.parse(body) as { stream?: boolean; prompt?: string };
      const content = `reply ${n}`;
      const chat = req.url === '/v1/chat/completions';
      const logprobs = stub.mode === 'bad-logprobs' ? { content: [{ token: 'x', logprob: 'high' }] } : null;
      if (req0.stream) {
        res.writeHead(200, { 'content-type': 'text/event-stream' });
        const delta = chat ? { delta: { role: 'assistant', content } } : { text: content };
        res.write(`data: ${JSON.stringify({ id: `c${n}`, choices: [{ index: 0, ...delta, finish_reason: null }] })}\n\n`);
        if (stub.mode === 'stall-stream') return; // the first chunk, then nothing
        res.write(`data: ${JSON.stringify({ id: `c${n}`, choices: [{ index: 0, ...(chat ? { delta: {} } : { text: '' }), finish_reason: 'stop' }] })}\n\n`);
        res.end('data: [DONE]\n\n');
        return;
      }
      const choice = chat ? { index: 0, message: { role: 'assistant', content }, finish_reason: 'stop', logprobs } : { index: 0, text: content, finish_reason: 'stop', logprobs };
      send(200, JSON.stringify({ id: `c${n}`, object: chat ? 'chat.completion' : 'text_completion', model: 'stub', choices: [choice] }));
    });
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  stub.server = server;
  stub.url = `http://127.0.0.1:${(server.address() as { port: number }).port}/v1`;
  stub.close = () =>
    new Promise((r) => {
      server.closeAllConnections();
      server.close(() => r());
    });
  return stub;
}
