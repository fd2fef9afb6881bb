/**
 * POSTs to the engine over node's http/https with keep-alive agents: the gateway's hot path. (The global
 * fetch costs tens of ms per call on loopback here, from how it writes a request; node:http with a pooled,
 * no-delay socket costs well under one.)
 */
import { Agent as HttpAgent, request as httpRequest, type IncomingMessage } from 'node:http';
import { Agent as HttpsAgent, request as httpsRequest } from 'node:https';

const agents = { http: new HttpAgent({ keepAlive: true, maxSockets: 1024 }), https: new HttpsAgent({ keepAlive: true, maxSockets: 1024 }) };

export interface Upstream {
  status: number;
  contentType: string | undefined;
  body: IncomingMessage;
  text(): Promise<string>;
  /** whether the deadline cut the response (a stream read from `body` then breaks with a bare "aborted") */
  timedOut(): boolean;
}

/**
 * Rejects with an Error named 'TimeoutError' after `timeoutMs` (headers and body), or the socket's error. The
 * deadline is one plain timer per call, cleared when the response closes: AbortSignal.timeout costs ~50 µs a
 * call here and keeps its timer pending for the whole timeout (600 k timers at 1k calls/s and the default 600 s).
 */
export function postUpstream(url: string, body: string, headers: Record<string, string>, timeoutMs: number): Promise<Upstream> {
  const tls = url.startsWith('https:');
  const timeout = () => Object.assign(new Error(`no answer within ${timeoutMs} ms`), { name: 'TimeoutError' });
  return new Promise((resolve, reject) => {
    let timedOut = false;
    let response: IncomingMessage | undefined;
    const req = (tls ? httpsRequest : httpRequest)(
      url,
      { method: 'POST', agent: tls ? agents.https : agents.http, headers: { ...headers, 'content-length': Buffer.byteLength(body) } },
      (res) => {
        response = res;
        res.once('close', () => clearTimeout(timer));
        resolve({
          status: res.statusCode ?? 0,
          contentType: res.headers['content-type'],
          body: res,
          text: async () => {
            const pieces: Buffer[] = [];
            let got = 0;
            try {
              for await (const piece of res) {
                pieces.push(piece as Buffer);
                got += (piece as Buffer).length;
              }
            } catch (err) {
              if (timedOut) throw timeout();
              // the engine (or the network) closed the connection mid-answer: say so, not a bare "aborted"
              const of = res.headers['content-length'] === undefined ? '' : ` of the ${res.headers['content-length']} it announced`;
              throw Object.assign(
                new Error(
                  `closed the connection after ${got} bytes of its answer${of} (${(err as Error).message}): the answer is truncated`,
                ),
                { name: 'TruncatedError' },
              );
            }
            return Buffer.concat(pieces, got).toString('utf8');
          },
          timedOut: () => timedOut,
        });
      },
    );
    const timer = setTimeout(() => {
      if (response?.complete) return; // read whole: its socket may serve another call by now
      timedOut = true;
      req.destroy(timeout());
    }, timeoutMs);
    req.on('error', (err) => {
      clearTimeout(timer);
      reject(timedOut ? timeout() : err);
    });
    req.on('socket', (s) => s.setNoDelay(true));
    req.end(body);
  });
}
