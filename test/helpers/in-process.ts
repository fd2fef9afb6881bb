/**
 * Services in this test process on one stub engine, all closed (the engine too) after each test.
 */
import { afterEach } from 'vitest';
import { Service, type ServiceOptions } from '../../src/serve/service.js';
import { tempDir } from './serve.js';
import { startStubEngine, type StubEngine } from './stub-engine.js';

export interface InProcess {
  /** the stub engine of the current test (started by its first service) */
  readonly stub: StubEngine | undefined;
  /** a listening service on the stub (`--tokenizer qwen3` unless told); its data directory is fresh unless given */
  start(opts?: Partial<ServiceOptions>): Promise<{ base: string; svc: Service }>;
  /** closes one service early (to restart it on the same data) */
  stop(svc: Service): Promise<void>;
}

export function inProcessServices(prefix: string): InProcess {
  let stub: StubEngine | undefined;
  const open: Service[] = [];
  afterEach(async () => {
    for (const s of open.splice(0)) await s.close();
    await stub?.close();
    stub = undefined;
  });
  return {
    get stub() {
      return stub;
    },
    async start(opts = {}) {
      stub ??= await startStubEngine();
      const svc = await Service.create({
        engineUrl: stub.url,
        dataDir: tempDir(prefix),
        port: 0,
        ...opts,
        packer: { tokenizer: 'qwen3', ...opts.packer },
      });
      open.push(svc);
      return { base: await svc.listen(), svc };
    },
    async stop(svc) {
      open.splice(open.indexOf(svc), 1);
      await svc.close();
    },
  };
}
