/**
 * The service is a part users opt into: its server, Redis client, metrics and SSE packages are optional peer
 * dependencies (package.json `peerDependencies` + `peerDependenciesMeta`), so `npm install treepack` installs the
 * packer without them. The CLI loads the service through here, never statically, so `treepack pack` and `stats`
 * run where they are absent and `treepack serve` says what to install.
 */
import { TreepackError } from '../errors.js';

/** The npm packages only the service imports: package.json's optional peers (test/package-shape.test.ts checks). */
export const SERVICE_PACKAGES = ['fastify', '@fastify/rate-limit', 'ioredis', 'prom-client', 'eventsource-parser'] as const;

/** The service's module, once every package it imports resolves; else one error naming those missing. */
export async function loadService(): Promise<typeof import('./service.js')> {
  const missing = SERVICE_PACKAGES.filter((name) => {
    try {
      import.meta.resolve(name);
      return false;
    } catch {
      return true;
    }
  });
  if (missing.length) {
    throw new TreepackError(
      'E_BACKEND',
      `treepack serve needs packages the packer does not install (missing: ${missing.join(', ')}): npm install ${SERVICE_PACKAGES.join(' ')}`,
    );
  }
  return import('./service.js');
}
