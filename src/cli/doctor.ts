/**
 * `treepack doctor`: which backends can run here, and for each one that cannot, why (not built, no driver, no
 * adapter). Never fails on an unavailable backend: that is what it reports.
 */
import { listBackends } from '../backend/index.js';
import { VERSION } from '../version.js';
import { parse } from './args.js';

export const DOCTOR_USAGE = `Usage: treepack doctor [--json]

Reports every backend (cuda, webgpu, cpu, js) in the order 'auto' tries them: available or not and why, and the
ops each implements. Exit code 0 whatever is available.

Options:
  --json       one JSON object: {version, node, platform, backends: [{name, priority, available, detail, ops, limits?}], webgpu_limits?}
  -h, --help   this help`;

export async function doctorCommand(argv: string[]): Promise<number> {
  const { values, positionals } = parse(argv, { json: { type: 'boolean' } }, DOCTOR_USAGE);
  if (values.help) {
    console.log(DOCTOR_USAGE);
    return 0;
  }
  if (positionals.length) {
    console.error(`treepack doctor: unexpected argument ${JSON.stringify(positionals[0])}\n\n${DOCTOR_USAGE}`);
    return 2;
  }
  const backends = await listBackends();
  // The limits decide the largest mask a WebGPU device can build (one storage buffer per output array).
  const webgpu_limits = backends.find((b) => b.name === 'webgpu')?.limits?.device;
  const report = {
    version: VERSION,
    node: process.version,
    platform: `${process.platform}-${process.arch}`,
    backends,
    ...(webgpu_limits ? { webgpu_limits } : {}),
  };
  if (values.json) {
    console.log(JSON.stringify(report, null, 2));
    return 0;
  }
  console.log(`treepack ${VERSION}, node ${process.version}, ${report.platform}`);
  for (const b of backends) {
    console.log(`  ${b.name.padEnd(7)} ${b.available ? 'available  ' : 'unavailable'}  ${b.detail}`);
    console.log(`          ops: ${b.ops.join(', ') || 'none'}`);
  }
  if (webgpu_limits)
    console.log(
      `  webgpu limits: maxStorageBufferBindingSize ${webgpu_limits.maxStorageBufferBindingSize} bytes, maxBufferSize ${webgpu_limits.maxBufferSize} bytes`,
    );
  return 0;
}
