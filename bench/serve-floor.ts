/**
 * The floor under the latency `treepack serve` adds, for `npm run bench:serve`: the least a Node proxy does for
 * the same calls on the same machine, run beside the gateway in the same rounds. node:http in; the engine hop the
 * gateway uses (src/serve/upstream.ts); with a log path, the request and the engine's answer appended to the
 * gateway's durable log (src/serve/log.ts: group commit, O_DSYNC) before answering, and an episode's finish
 * (`POST …/finish`) appended too, as the gateway logs both. No routing framework, no checks, no pool, no metrics:
 * what the gateway adds over this floor is its own cost, the rest is the machine's.
 * `GET /writes` answers how long its log's durable writes took since the last such GET, in ms.
 * Usage: tsx bench/serve-floor.ts ENGINE_URL [LOG_PATH]; prints its URL on stdout.
 */
import { createServer } from 'node:http';
import { DurableLog } from '../src/serve/log.js';
import { postUpstream } from '../src/serve/upstream.js';

const [engine, logPath] = process.argv.slice(2);
if (!engine) throw new Error('usage: serve-floor.ts ENGINE_URL [LOG_PATH]');
const log = logPath ? await DurableLog.open(logPath, () => {}) : undefined;
let writes: number[] = [];
if (log) log.onWrite = (seconds) => writes.push(seconds * 1000);

const server = createServer((req, res) => {
  if (req.method === 'GET' && req.url === '/writes') {
    res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify(writes));
    writes = [];
    return;
  }
  const chunks: Buffer[] = [];
  req.on('data', (d: Buffer) => chunks.push(d));
  req.on('end', async () => {
    try {
      const body = Buffer.concat(chunks).toString();
      if (req.url!.endsWith('/finish')) {
        await log?.append({ type: 'finish', url: req.url, body });
        res.writeHead(200, { 'content-type': 'application/json' }).end('{}');
        return;
      }
      const up = await postUpstream(`${engine}/chat/completions`, body, { 'content-type': 'application/json' }, 60_000);
      const text = await up.text();
      await log?.append({ type: 'call', request: body, output: text });
      res.writeHead(up.status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(text) });
      res.end(text);
    } catch (err) {
      res.writeHead(502).end((err as Error).message);
    }
  });
});
server.listen(0, '127.0.0.1', () => console.log(`http://127.0.0.1:${(server.address() as { port: number }).port}`));
