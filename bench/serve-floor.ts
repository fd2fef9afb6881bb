/**
 * The floor under the latency `treepack serve` adds, for `npm run bench:serve`: the least a Node proxy does for
 * the same calls on the same machine, run beside the gateway in the same rounds, and written apart from the
 * gateway so it measures the machine, not treepack. node:http in; a pooled keep-alive, no-delay request to the
 * engine; with a log path, the request and the engine's answer appended as one line to a file opened O_DSYNC
 * (calls arriving during a write go together in the next: group commit) before answering, and an episode's finish
 * (`POST …/finish`) appended too, as the gateway logs both. No routing framework, no checks, no pool, no metrics.
 * `GET /writes` answers how long its durable writes took since the last such GET, in ms.
 * Usage: tsx bench/serve-floor.ts ENGINE_URL [LOG_PATH]; prints its URL on stdout.
 */
import { constants, openSync, write } from 'node:fs';
import { Agent, createServer, request } from 'node:http';
import { performance } from 'node:perf_hooks';

const [engine, logPath] = process.argv.slice(2);
if (!engine) throw new Error('usage: serve-floor.ts ENGINE_URL [LOG_PATH]');
const fd = logPath ? openSync(logPath, constants.O_WRONLY | constants.O_APPEND | constants.O_CREAT | constants.O_DSYNC) : undefined;
let writes: number[] = [];
let queue: { line: string; done: () => void }[] = [];
let writing = false;

/** Resolves once `line` is on disk; lines queued while a write is in flight go in the next one. */
function append(line: string): Promise<void> {
  if (fd === undefined) return Promise.resolve();
  return new Promise((done) => {
    queue.push({ line, done });
    if (!writing) flush();
  });
}

function flush(): void {
  const batch = queue;
  queue = [];
  writing = batch.length > 0;
  if (!writing) return;
  const bytes = Buffer.from(batch.map((p) => p.line).join(''));
  const t0 = performance.now();
  write(fd!, bytes, (err, n) => {
    if (err || n !== bytes.length) throw err ?? new Error(`short write: ${n} of ${bytes.length} bytes`);
    writes.push(performance.now() - t0);
    for (const p of batch) p.done();
    flush();
  });
}

const agent = new Agent({ keepAlive: true, maxSockets: 1024 });
const url = new URL(`${engine}/chat/completions`);

function callEngine(body: string): Promise<{ status: number; text: string }> {
  return new Promise((resolve, reject) => {
    const req = request(
      {
        hostname: url.hostname,
        port: url.port,
        path: url.pathname,
        method: 'POST',
        agent,
        headers: { 'content-type': 'application/json', 'content-length': Buffer.byteLength(body) },
      },
      (res) => {
        let text = '';
        res.setEncoding('utf8');
        res.on('data', (d: string) => (text += d));
        res.on('end', () => resolve({ status: res.statusCode ?? 0, text }));
      },
    );
    req.on('socket', (s) => s.setNoDelay(true));
    req.on('error', reject);
    req.end(body);
  });
}

const server = createServer((req, res) => {
  if (req.method === 'GET' && req.url === '/writes') {
    res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify(writes));
    writes = [];
    return;
  }
  const chunks: Buffer[] = [];
  req.on('data', (d: Buffer) => chunks.push(d));
  // The handler catches every error itself: nothing awaits the request's end event.
  req.on(
    'end',
    () =>
      void (async () => {
        try {
          const body = Buffer.concat(chunks).toString();
          if (req.url!.endsWith('/finish')) {
            await append(JSON.stringify({ type: 'finish', url: req.url, body }) + '\n');
            res.writeHead(200, { 'content-type': 'application/json' }).end('{}');
            return;
          }
          const up = await callEngine(body);
          await append(JSON.stringify({ type: 'call', request: body, output: up.text }) + '\n');
          res.writeHead(up.status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(up.text) });
          res.end(up.text);
        } catch (err) {
          res.writeHead(502).end((err as Error).message);
        }
      })(),
  );
});
server.listen(0, '127.0.0.1', () => console.log(`http://127.0.0.1:${(server.address() as { port: number }).port}`));
