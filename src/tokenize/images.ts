/**
 * The vision-language processor's arithmetic (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, as transformers implements it): how
 * many placeholder tokens an image expands into (`smart_resize`), its patch grid, and the 3-D rotary positions
 * (`get_rope_index`) of a token sequence with images. test/images-python.test.ts checks each against transformers.
 */
import { createHash } from 'node:crypto';
import { readFile } from 'node:fs/promises';
import path from 'node:path';
import { TreepackError } from '../errors.js';
import {
  VL_FAMILIES,
  type DecodedImage,
  type ImageProcessor,
  type ImageSpan,
  type ProcessedImage,
  type VlFamily,
} from '../records/images.js';

const PROCESSOR_CLASSES: Readonly<Record<string, VlFamily>> = {
  Qwen2VLProcessor: 'qwen2_vl',
  Qwen2_5_VLProcessor: 'qwen2_5_vl',
  Qwen3VLProcessor: 'qwen3_vl',
};

/** Why a processor refuses an image (transformers raises ValueError); the encoder names record and field. */
export class ImageRefusedError extends Error {}

/** Python's round(): half to even, as smart_resize rounds. */
function pyRound(x: number): number {
  const f = Math.floor(x);
  const d = x - f;
  if (d > 0.5) return f + 1;
  if (d < 0.5) return f;
  return f % 2 === 0 ? f : f + 1;
}

/** transformers' `smart_resize` (Qwen2-VL image processor): the resized (height, width), multiples of `factor`. */
export function smartResize(height: number, width: number, factor: number, minPixels: number, maxPixels: number): [number, number] {
  if (Math.max(height, width) / Math.min(height, width) > 200)
    throw new ImageRefusedError(
      `absolute aspect ratio must be smaller than 200, got ${Math.max(height, width) / Math.min(height, width)} (${height}×${width})`,
    );
  let h = pyRound(height / factor) * factor;
  let w = pyRound(width / factor) * factor;
  if (h * w > maxPixels) {
    const beta = Math.sqrt((height * width) / maxPixels);
    h = Math.max(factor, Math.floor(height / beta / factor) * factor);
    w = Math.max(factor, Math.floor(width / beta / factor) * factor);
  } else if (h * w < minPixels) {
    const beta = Math.sqrt(minPixels / (height * width));
    h = Math.ceil((height * beta) / factor) * factor;
    w = Math.ceil((width * beta) / factor) * factor;
  }
  return [h, w];
}

/** The processor's grid (t, h, w in patches) of a still image: one temporal patch (the frame is repeated). */
export function imageGrid(height: number, width: number, p: ImageProcessor): [number, number, number] {
  const [h, w] = smartResize(height, width, p.patch_size * p.merge_size, p.min_pixels, p.max_pixels);
  return [1, h / p.patch_size, w / p.patch_size];
}

/** An image's identity, grid and placeholder count under `p`. */
export function processImage(img: DecodedImage, p: ImageProcessor): ProcessedImage {
  const grid = imageGrid(img.height, img.width, p);
  const hash = createHash('sha256').update(processorKey(p)).update('\n').update(img.sha256).digest('hex');
  return { ...img, hash, grid, tokens: (grid[0] * grid[1] * grid[2]) / (p.merge_size * p.merge_size), processor: p };
}

/** The settings that change what an image becomes, in a fixed order. */
export function processorKey(p: ImageProcessor): string {
  return JSON.stringify([p.family, p.patch_size, p.merge_size, p.temporal_patch_size, p.min_pixels, p.max_pixels, p.image_token_id]);
}

/**
 * The 3-D rotary positions (temporal, height, width) of a sequence of `length` tokens whose images lie at `spans`
 * (ascending), as `[3 * length]` (row d at d·length): get_rope_index of Qwen2-VL / 2.5-VL / 3-VL for still images.
 * Text continues one past the largest position before it; an image's tokens sit at (s, s + row, s + col) in
 * merged patches from its start s, and the text after it starts at s + max(rows, cols).
 */
export function ropeIndex(length: number, spans: readonly ImageSpan[], mergeSize: number): Int32Array {
  const out = new Int32Array(3 * length);
  let pos = 0;
  let t = 0;
  const text = (end: number) => {
    for (; t < end; t++, pos++) out[t] = out[length + t] = out[2 * length + t] = pos;
  };
  for (const { start, image } of spans) {
    text(start);
    const rows = image.grid[1] / mergeSize,
      cols = image.grid[2] / mergeSize;
    for (let f = 0; f < image.grid[0]; f++)
      for (let r = 0; r < rows; r++)
        for (let c = 0; c < cols; c++, t++) {
          out[t] = pos + f;
          out[length + t] = pos + r;
          out[2 * length + t] = pos + c;
        }
    pos += Math.max(rows, cols);
  }
  text(length);
  return out;
}

type Json = Record<string, unknown>;

async function readOptionalJson(file: string): Promise<Json | undefined> {
  let text: string;
  try {
    text = await readFile(file, 'utf8');
  } catch {
    return undefined;
  }
  try {
    return JSON.parse(text) as Json;
  } catch (e) {
    throw new TreepackError('E_ARG', `malformed JSON: ${(e as Error).message}`, { file });
  }
}

/**
 * The image processor of a tokenizer directory: `preprocessor_config.json` (Hugging Face's, as a VL model ships it),
 * the family from its `processor_class` or from `config.json`'s `model_type`, the placeholder ids from `config.json`
 * or the tokenizer's added tokens. Undefined when the directory has no preprocessor_config.json (a text model).
 */
export async function loadImageProcessor(
  dir: string,
  addedTokenId: (s: string) => number | undefined,
): Promise<ImageProcessor | undefined> {
  const file = path.join(dir, 'preprocessor_config.json');
  const pre = await readOptionalJson(file);
  if (pre === undefined) return undefined;
  const config = (await readOptionalJson(path.join(dir, 'config.json'))) ?? {};
  const bad = (field: string, what: string) => new TreepackError('E_ARG', `${field}: expected ${what}`, { file, field });
  const family =
    PROCESSOR_CLASSES[String(pre.processor_class)] ?? (VL_FAMILIES as readonly string[]).find((f) => f === config.model_type) ?? undefined;
  if (family === undefined)
    throw bad(
      'processor_class',
      `one of ${Object.keys(PROCESSOR_CLASSES).join(', ')} (or config.json model_type ${VL_FAMILIES.join(', ')})`,
    );
  const size = (typeof pre.size === 'object' && pre.size !== null ? pre.size : {}) as Json;
  const int = (v: unknown, field: string, fallback: number): number => {
    if (v === undefined || v === null) return fallback;
    if (!Number.isSafeInteger(v) || (v as number) < 1) throw bad(field, 'a positive integer');
    return v as number;
  };
  const id = (key: string, token: string): number => {
    const v = config[key] ?? addedTokenId(token);
    if (!Number.isSafeInteger(v)) throw bad(key, `an id in config.json or the added token ${token} in the tokenizer`);
    return v as number;
  };
  const p: ImageProcessor = {
    family,
    patch_size: int(pre.patch_size, 'patch_size', 14),
    merge_size: int(pre.merge_size, 'merge_size', 2),
    temporal_patch_size: int(pre.temporal_patch_size, 'temporal_patch_size', 2),
    min_pixels: int(pre.min_pixels ?? size.shortest_edge, 'min_pixels', 56 * 56),
    max_pixels: int(pre.max_pixels ?? size.longest_edge, 'max_pixels', 28 * 28 * 1280),
    image_token_id: id('image_token_id', '<|image_pad|>'),
    vision_start_token_id: id('vision_start_token_id', '<|vision_start|>'),
    vision_end_token_id: id('vision_end_token_id', '<|vision_end|>'),
  };
  if (p.min_pixels > p.max_pixels) throw bad('min_pixels', `at most max_pixels = ${p.max_pixels}`);
  for (const key of ['image_mean', 'image_std'] as const) {
    const v = pre[key];
    if (Array.isArray(v) && v.every((x) => typeof x === 'number')) p[key] = v;
  }
  if (typeof pre.rescale_factor === 'number') p.rescale_factor = pre.rescale_factor;
  if (typeof pre.resample === 'number') p.resample = pre.resample;
  return p;
}
