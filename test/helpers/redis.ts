/**
 * A real `redis-server` (Debian's package) on loopback for the shared-pool tests: its own port and directory,
 * no snapshots, the append-only file fsync'd on every write, so a restart (kill -9 included) keeps everything
 * Redis acknowledged. Absent redis-server skips the suite with the reason, unless TREEPACK_REQUIRE_REDIS=1 (CI).
 */
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { createInterface } from 'node:readline';
import { freePort, tempDir } from './serve.js';

/** Whether redis-server runs here; otherwise prints why the suite is skipped (fails it under TREEPACK_REQUIRE_REDIS=1). */
export function redisAvailable(suite: string): boolean {
  const r = spawnSync('redis-server', ['--version'], { encoding: 'utf8' });
  if (r.status === 0) return true;
  const reason = `redis-server not found (${r.error?.message ?? r.stderr}); install it with apt-get install redis-server`;
  if (process.env.TREEPACK_REQUIRE_REDIS === '1') throw new Error(`${suite}: TREEPACK_REQUIRE_REDIS=1 but ${reason}`);
  console.log(`${suite} skipped: ${reason}`);
  return false;
}

export interface RedisServer {
  url: string;
  dir: string;
  /** kill -9 and start again on the same port and directory (the append-only file is replayed) */
  restart: () => Promise<void>;
  stop: () => Promise<void>;
}

function launch(port: number, dir: string, extra: string[]): Promise<ChildProcess> {
  const child = spawn(
    'redis-server',
    ['--bind', '127.0.0.1', '--port', String(port), '--dir', dir, '--save', '', '--appendonly', 'yes', '--appendfsync', 'always', ...extra],
    { stdio: ['ignore', 'pipe', 'pipe'] },
  );
  return new Promise((res, rej) => {
    let out = '';
    const t = setTimeout(() => rej(new Error(`redis-server not ready after 20 s: ${out.slice(-2000)}`)), 20_000);
    createInterface({ input: child.stdout }).on('line', (line) => {
      out += line + '\n';
      if (line.includes('Ready to accept connections')) {
        clearTimeout(t);
        res(child);
      }
    });
    child.on('exit', (code) => {
      clearTimeout(t);
      rej(new Error(`redis-server exited with ${code}: ${out.slice(-2000)}`));
    });
  });
}

function kill(child: ChildProcess): Promise<void> {
  return new Promise((res) => {
    if (child.exitCode !== null || child.signalCode !== null) return res();
    child.once('exit', () => res());
    child.kill('SIGKILL');
  });
}

/** `extra`: redis-server flags after the defaults (a later flag overrides an earlier one). */
export async function startRedis(extra: string[] = []): Promise<RedisServer> {
  const port = await freePort();
  const dir = tempDir('tp-redis-');
  let child = await launch(port, dir, extra);
  return {
    url: `redis://127.0.0.1:${port}`,
    dir,
    restart: async () => {
      await kill(child);
      child = await launch(port, dir, extra);
    },
    stop: () => kill(child),
  };
}
