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
}

/** Rejects with an Error named 'TimeoutError' after `timeoutMs` (headers and body), or the socket's error. */
export function postUpstream(url: string, body: string, headers: Record<string, string>, timeoutMs: number): Promise<Upstream> {
  const tls = url.startsWith('https:');
  const signal = AbortSignal.timeout(timeoutMs);
  return new Promise((resolve, reject) => {
    const req = (tls ? httpsRequest : httpRequest)(
      url,
      { method: 'POST', agent: tls ? agents.https : agents.http, signal, headers: { ...headers, 'content-length': Buffer.byteLength(body) } },
      (res) => {
        resolve({
          status: res.statusCode ?? 0,
          contentType: res.headers['content-type'],
          body: res,
          text: async () => {
            let s = '';
            res.setEncoding('utf8');
            for await (const piece of res) s += piece as string;
            return s;
          },
        });
      },
    );
    req.on('error', (err) => reject(signal.aborted ? Object.assign(new Error('timeout'), { name: 'TimeoutError' }) : err));
    req.on('socket', (s) => s.setNoDelay(true));
    req.end(body);
  });
}
