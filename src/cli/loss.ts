/**
 * `treepack loss`: the RL loss of a dumped micro-batch and node logprobs, so a trainer's numbers can be checked
 * offline. Prints {loss, metrics, backend}; optionally writes dloss/dlp as a safetensors file.
 */
import { readFileSync } from 'node:fs';
import { ioError } from '../io/atomic.js';
import { TreepackError } from '../errors.js';
import { readMicroBatch } from '../io/microbatch.js';
import { readSafetensors, writeSafetensors } from '../io/safetensors.js';
import { computeLoss } from '../backend/index.js';
import { backendOption, parse, usageError } from './args.js';

export const LOSS_USAGE = `Usage: treepack loss <microbatch.safetensors> --logprobs FILE --config loss.json [options]

Computes the per-token clipped-ratio RL loss of one packed micro-batch from node logprobs (tensor "logprobs",
float32 [N], in a safetensors file), exactly as on the unpacked batch, and prints {"loss", "metrics"}.

Options:
  --logprobs FILE       safetensors file with tensor "logprobs" F32 [N]                    [required]
  --config FILE         loss config JSON (policy, clip_low, clip_high, dual_clip, aggregation, kl, kl_coef,
                        tis, tis_cap, log_ratio_clamp, norm_constant, global_tokens, global_sequences)
                                                                                         [default: {}]
  --backend NAME        auto, cuda, webgpu, cpu, js                                        [default: auto]
  --grad-out FILE       write dloss/dlp as tensor "grad" F32 [N] (atomically)
  --json                one JSON object on stdout
  -h, --help            this help`;

export async function lossCommand(argv: string[]): Promise<number> {
  const { values, positionals } = parse(
    argv,
    {
      logprobs: { type: 'string' },
      config: { type: 'string' },
      backend: { type: 'string' },
      'grad-out': { type: 'string' },
      json: { type: 'boolean' },
    },
    LOSS_USAGE,
  );
  if (values.help) {
    console.log(LOSS_USAGE);
    return 0;
  }
  if (positionals.length !== 1) throw usageError(`expected exactly one micro-batch file, got ${positionals.length}\n\n${LOSS_USAGE}`);
  const lpFile = values.logprobs as string | undefined;
  if (!lpFile) throw usageError(`--logprobs FILE is required\n\n${LOSS_USAGE}`);
  const backend = backendOption(values.backend as string | undefined);
  const { batch } = readMicroBatch(positionals[0]);
  const lpTensor = readSafetensors(lpFile).tensors.get('logprobs');
  if (!lpTensor || lpTensor.dtype !== 'F32' || lpTensor.shape.length !== 1) {
    throw new TreepackError(
      'E_INPUT',
      `expected a tensor "logprobs" of dtype F32 and shape [N]${lpTensor ? `, got ${lpTensor.dtype} [${lpTensor.shape.join(', ')}]` : ', found none'}`,
      { file: lpFile, field: 'logprobs' },
    );
  }
  let config: Record<string, unknown> = {};
  const configFile = values.config as string | undefined;
  if (configFile) {
    let text: string;
    try {
      text = readFileSync(configFile, 'utf8');
    } catch (err) {
      throw ioError(err, configFile);
    }
    try {
      config = JSON.parse(text) as Record<string, unknown>;
    } catch (err) {
      throw new TreepackError('E_INPUT', `not valid JSON: ${(err as Error).message}`, { file: configFile });
    }
  }
  let res;
  try {
    res = await computeLoss(batch, lpTensor.data as Float32Array, config, { backend });
  } catch (err) {
    // Name the file the bad field came from.
    if (err instanceof TreepackError && !err.where.file) {
      const file = err.where.field === 'logprobs' ? lpFile : err.code === 'E_ARG' ? configFile : positionals[0];
      throw new TreepackError(err.code, err.detail, { ...err.where, file });
    }
    throw err;
  }
  const gradOut = values['grad-out'] as string | undefined;
  if (gradOut)
    writeSafetensors(gradOut, new Map([['grad', { dtype: 'F32', shape: [res.grad.length], data: res.grad }]]), {
      format: 'treepack/1',
      kind: 'dloss/dlp',
    });
  if (values.json) {
    console.log(JSON.stringify({ loss: res.loss, metrics: res.metrics, backend: res.backend }));
  } else {
    console.log(`loss ${res.loss}`);
    for (const [k, v] of Object.entries(res.metrics)) console.log(`  ${k.padEnd(17)} ${v}`);
    console.error(`treepack: ${res.report}`);
  }
  return 0;
}
