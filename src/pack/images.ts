/**
 * Images in the forest (docs/reference/format.md, "Images"). Every placeholder token of a VL model has one id, so
 * two images of one size would render to equal token runs and merge. Before any sort or trie, the placeholders of
 * image i get keys of their own, −(1 + base_i + j) for placeholder j, with images ordered by identity (hash) and
 * base_i the placeholders of the images before: the same image resent by a later call keys alike and shares, two
 * images never do. Keys are plain int32 token ids below every real one, so every backend's packForest, the budget
 * planner and `treepack stats` see image identity without knowing of images. The micro-batch then gets its ids back,
 * and each image's node runs (fills), pixels and 3-D rotary positions.
 */
import { TreepackError } from '../errors.js';
import type { Sample } from '../records/types.js';
import type { ImageProcessor, ProcessedImage } from '../records/images.js';
import { processorKey, ropeIndex } from '../tokenize/images.js';
import { MAX_TOKENS, type Forest, type ImageTensors, type MicroBatchMeta, type Sequences } from './contract.js';

/** The distinct images of some samples, by identity, and where each one's keys start. */
export interface ImageTable {
  images: ProcessedImage[];
  /** base[i] = placeholders of images 0..i-1; base[I] = all */
  base: Int32Array;
}

/** The table of the samples' images, or undefined when none has any. */
export function imageTable(samples: readonly Sample[]): ImageTable | undefined {
  const byHash = new Map<string, ProcessedImage>();
  for (const s of samples) for (const { image } of s.images ?? []) byHash.set(image.hash, image);
  if (byHash.size === 0) return undefined;
  const images = [...byHash.values()].sort((a, b) => (a.hash < b.hash ? -1 : a.hash > b.hash ? 1 : 0));
  const key = processorKey(images[0].processor);
  const base = new Int32Array(images.length + 1);
  for (let i = 0; i < images.length; i++) {
    if (processorKey(images[i].processor) !== key)
      throw new TreepackError('E_INPUT', 'images of one micro-batch were processed with different image processors');
    if (base[i] + images[i].tokens > MAX_TOKENS) throw new TreepackError('E_LIMIT', `more than ${MAX_TOKENS} image placeholders`);
    base[i + 1] = base[i] + images[i].tokens;
  }
  return { images, base };
}

/** Overwrites each image placeholder of `seqs` (the samples' tokens, concatenated in order) with its key. */
export function keyImages(samples: readonly Sample[], seqs: Sequences, table: ImageTable): void {
  const index = new Map(table.images.map((img, i) => [img.hash, i]));
  samples.forEach((s, k) => {
    for (const { start, image } of s.images ?? []) {
      const i = index.get(image.hash)!;
      const at = seqs.offsets[k] + start;
      for (let j = 0; j < image.tokens; j++) seqs.tokens[at + j] = -(1 + table.base[i] + j);
    }
  });
}

/** Image index of key slot k (0-based: key = −(1 + k)). */
function imageOf(base: Int32Array, k: number): number {
  let lo = 0,
    hi = base.length - 2;
  while (lo < hi) {
    const mid = (lo + hi + 1) >> 1;
    if (base[mid] <= k) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/**
 * Gives the forest its placeholder ids back (in place) and returns the micro-batch's image tensors: pixels, sizes,
 * grids, fills (maximal runs of consecutive nodes holding consecutive placeholders of one image) and the 3-D rotary
 * positions, each node's taken from any sequence through it (a node's root path fixes them).
 */
export function imageTensors(
  samples: readonly Sample[],
  forest: Forest,
  table: ImageTable,
): { tensors: ImageTensors; meta: Pick<MicroBatchMeta, 'image_processor' | 'image_hashes'> } {
  const { images, base } = table;
  const processor: ImageProcessor = images[0].processor;
  const ids = forest.input_ids;
  const N = ids.length;
  const fills: number[] = [];
  let open = -1; // index in fills of the run the previous node extends, or -1
  for (let p = 0; p < N; p++) {
    if (ids[p] >= 0) {
      open = -1;
      continue;
    }
    const k = -ids[p] - 1;
    const i = imageOf(base, k);
    const j = k - base[i];
    ids[p] = processor.image_token_id;
    const f = open;
    if (f >= 0 && fills[f] === i && forest.parent[p] === p - 1 && fills[f + 2] + fills[f + 3] === j) fills[f + 3]++;
    else {
      open = fills.length;
      fills.push(i, p, j, 1);
    }
  }
  let bytes = 0;
  for (const img of images) bytes += img.rgb.length;
  const image_pixels = new Uint8Array(bytes);
  const image_sizes = new Int32Array(2 * images.length);
  const image_grid_thw = new Int32Array(3 * images.length);
  bytes = 0;
  images.forEach((img, i) => {
    image_pixels.set(img.rgb, bytes);
    bytes += img.rgb.length;
    image_sizes.set([img.height, img.width], 2 * i);
    image_grid_thw.set(img.grid, 3 * i);
  });
  const mrope_position_ids = new Int32Array(3 * N);
  samples.forEach((s, k) => {
    const len = s.tokens.length;
    const rope = ropeIndex(len, s.images ?? [], processor.merge_size);
    const off = forest.seq_offsets[k];
    for (let t = 0; t < len; t++) {
      const p = forest.seq_positions[off + t];
      mrope_position_ids[p] = rope[t];
      mrope_position_ids[N + p] = rope[len + t];
      mrope_position_ids[2 * N + p] = rope[2 * len + t];
    }
  });
  return {
    tensors: { image_pixels, image_sizes, image_grid_thw, image_fills: Int32Array.from(fills), mrope_position_ids },
    meta: { image_processor: { ...processor }, image_hashes: images.map((img) => img.hash) },
  };
}
