/**
 * WebGPU device acquisition through the `webgpu` package (Dawn for Node), tried once per process.
 *
 * Order: the platform's native adapter (Vulkan, Metal, D3D12), then Dawn's OpenGL ES backend in compatibility
 * mode, which runs on Mesa's llvmpipe with no GPU at all (Dawn refuses Mesa 22's lavapipe Vulkan): the software adapter
 * CI tests on. `TREEPACK_WEBGPU_BACKEND=vulkan|opengles|…` pins one Dawn backend.
 */
import { createRequire } from 'node:module';

export interface WebGPUContext {
  /**
   * The Dawn instance. It must stay referenced while any device lives: if it is garbage collected the process
   * crashes (SIGSEGV or "Owner died", reproduced with --expose-gc). The context is cached for the life of the process,
   * and so is this reference.
   */
  gpu: GPU;
  device: GPUDevice;
  adapter: GPUAdapter;
  /** Dawn backend flag used ('default' = the platform's native one), and what the adapter says it is. */
  backend: string;
  description: string;
  isFallbackAdapter: boolean;
}

type Acquired = { ok: true; ctx: WebGPUContext } | { ok: false; reason: string };

let acquired: Promise<Acquired> | undefined;

async function acquire(): Promise<Acquired> {
  // Mesa's EGL needs a platform with no display server; both are harmless elsewhere.
  process.env.EGL_PLATFORM ??= 'surfaceless';
  process.env.XDG_RUNTIME_DIR ??= '/tmp';
  let webgpu: { create: (flags: string[]) => GPU; globals: object };
  try {
    // Resolved at run time: `webgpu` is an optional dependency and may be absent.
    const require = createRequire(import.meta.url);
    webgpu = (await import(require.resolve('webgpu'))) as typeof webgpu;
  } catch (err) {
    return { ok: false, reason: `package 'webgpu' not installed (${(err as Error).message.split('\n')[0]})` };
  }
  // WGSL-facing constants (GPUBufferUsage, GPUMapMode, …) are globals in browsers; Dawn exports them.
  for (const [k, v] of Object.entries(webgpu.globals)) if (!(k in globalThis)) (globalThis as Record<string, unknown>)[k] = v;
  const pinned = process.env.TREEPACK_WEBGPU_BACKEND;
  const attempts: [string, GPURequestAdapterOptions | undefined][] = pinned
    ? [[pinned, pinned === 'opengles' || pinned === 'opengl' ? { featureLevel: 'compatibility' } : undefined]]
    : [
        ['default', undefined],
        ['opengles', { featureLevel: 'compatibility' }],
      ];
  const failures: string[] = [];
  for (const [backend, options] of attempts) {
    const gpu = webgpu.create(backend === 'default' ? [] : [`backend=${backend}`]);
    const adapter = await gpu.requestAdapter(options);
    if (!adapter) {
      failures.push(`${backend}: no adapter`);
      continue;
    }
    const device = await adapter.requestDevice({
      requiredLimits: {
        maxStorageBufferBindingSize: adapter.limits.maxStorageBufferBindingSize,
        maxBufferSize: adapter.limits.maxBufferSize,
      },
    });
    const info = adapter.info;
    const description = [info.vendor, info.architecture, info.device, info.description].filter(Boolean).join(' ') || 'unnamed adapter';
    return {
      ok: true,
      ctx: {
        gpu,
        device,
        adapter,
        backend,
        description,
        isFallbackAdapter: (info as { isFallbackAdapter?: boolean }).isFallbackAdapter === true || backend === 'opengles',
      },
    };
  }
  return { ok: false, reason: `no WebGPU adapter (${failures.join('; ')})` };
}

/** The shared device, or why there is none. Never throws; later calls return the first outcome. */
export function webgpuContext(): Promise<Acquired> {
  acquired ??= acquire();
  return acquired;
}

/** Destroys the device so the process can exit; a later webgpuContext() starts over. */
export async function releaseWebGPU(): Promise<void> {
  const a = await acquired;
  acquired = undefined;
  if (a?.ok) a.ctx.device.destroy();
}
