/**
 * Image content parts of chat records: a data URL or a file path relative to the input file, decoded to RGB bytes;
 * and the types of what the processor makes of an image (src/tokenize/images.ts), which samples carry.
 *
 * Decoding is pure JS (pngjs, jpeg-js): no native image library to build, and the bytes are the image's identity
 * (their sha256, with the processor settings: src/tokenize/images.ts), so whatever decoded them must be the one
 * decoder every packer run uses. Remote URLs are refused: packing never reaches the network.
 */
import { createHash } from 'node:crypto';
import { readFileSync, statSync } from 'node:fs';
import path from 'node:path';
import jpeg from 'jpeg-js';
import { PNG } from 'pngjs';

/** An image as the record gave it, decoded: row-major height × width × 3 RGB bytes, alpha dropped. */
export interface DecodedImage {
  height: number;
  width: number;
  rgb: Uint8Array;
  /** sha256 hex of height, width and the RGB bytes (the processor settings join it in src/tokenize/images.ts) */
  sha256: string;
}

/** Largest decoded image accepted (pixels): a 16k × 16k screenshot; bigger is a corrupt header, not a picture. */
const MAX_PIXELS = 1 << 28;

/**
 * Decoded images by reference (a data URL's sha256, a file's path, size and mtime), least recently used first: an
 * agent resends every earlier screenshot with each call, and decoding is most of reading a record.
 */
const decoded = new Map<string, DecodedImage>();
let decodedBytes = 0;
const MAX_DECODED_BYTES = 256 << 20;

function remember(key: string, load: () => DecodedImage): DecodedImage {
  const hit = decoded.get(key);
  if (hit) {
    decoded.delete(key);
    decoded.set(key, hit);
    return hit;
  }
  const img = load();
  decoded.set(key, img);
  decodedBytes += img.rgb.length;
  for (const [k, v] of decoded) {
    if (decodedBytes <= MAX_DECODED_BYTES || k === key) break;
    decoded.delete(k);
    decodedBytes -= v.rgb.length;
  }
  return img;
}

/** A base64 data URL of an image (or of no stated type), up to its payload. */
const DATA_URL = /^data:(image\/[a-z0-9.+-]+)?(;[^,]*)?;base64,/i;

/** The bytes of a base64 data URL, or undefined when `url` is none. */
export function dataUrlBytes(url: string): Buffer | undefined {
  const m = DATA_URL.exec(url);
  return m ? Buffer.from(url.slice(m[0].length), 'base64') : undefined;
}

/** Why an image reference cannot be read; the reader turns it into an E_INPUT naming record and field. */
export class ImageInputError extends Error {}

/**
 * Reads and decodes the image an `image_url.url` names: `data:image/png;base64,...` (or jpeg), or a file path
 * resolved against `baseDir` (the input file's directory). http(s) and other schemes are refused.
 */
export function loadImage(url: string, baseDir: string): DecodedImage {
  if (url.startsWith('data:')) {
    if (!DATA_URL.test(url)) throw new ImageInputError('expected a base64 data URL: data:image/png;base64,...');
    const key = 'data:' + createHash('sha256').update(url).digest('hex');
    return remember(key, () => decodeImage(dataUrlBytes(url)!));
  } else if (/^[a-z][a-z0-9+.-]*:\/\//i.test(url)) {
    throw new ImageInputError(
      `remote image ${JSON.stringify(url.slice(0, 80))} refused: treepack never fetches over the network; ` +
        'inline it as a data URL or a local file path',
    );
  } else {
    const file = path.resolve(baseDir, url.startsWith('file:') ? url.slice(5) : url);
    const unreadable = (e: unknown) =>
      new ImageInputError(`cannot read image file ${file}: ${(e as NodeJS.ErrnoException).code ?? (e as Error).message}`);
    let key: string;
    try {
      const st = statSync(file);
      key = `file:${st.size}:${st.mtimeMs}:${file}`;
    } catch (e) {
      throw unreadable(e);
    }
    return remember(key, () => {
      let bytes: Uint8Array;
      try {
        bytes = readFileSync(file);
      } catch (e) {
        throw unreadable(e);
      }
      return decodeImage(bytes);
    });
  }
}

/** PNG or JPEG bytes → RGB; the format is told by its signature, never by a file name or MIME type. */
export function decodeImage(bytes: Uint8Array): DecodedImage {
  const buf = Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  let width: number, height: number, rgba: Uint8Array, channels: number;
  try {
    if (buf.length >= 8 && buf.readUInt32BE(0) === 0x89504e47) {
      // pngjs rescales every bit depth and colour type to 8-bit RGBA.
      const png = PNG.sync.read(buf);
      ({ width, height } = png);
      rgba = png.data;
      channels = 4;
    } else if (buf.length >= 3 && buf[0] === 0xff && buf[1] === 0xd8 && buf[2] === 0xff) {
      const img = jpeg.decode(buf, { useTArray: true, formatAsRGBA: false, maxResolutionInMP: MAX_PIXELS / 1e6 });
      ({ width, height } = img);
      rgba = img.data;
      channels = 3;
    } else {
      throw new ImageInputError('not a PNG or JPEG image (unknown signature)');
    }
  } catch (e) {
    if (e instanceof ImageInputError) throw e;
    throw new ImageInputError(`undecodable image: ${(e as Error).message}`);
  }
  if (!(width > 0 && height > 0) || width * height > MAX_PIXELS)
    throw new ImageInputError(`image of ${height}×${width} pixels: expected 1 to ${MAX_PIXELS} pixels`);
  let rgb: Uint8Array;
  if (channels === 3) rgb = rgba.length === width * height * 3 ? rgba : rgba.subarray(0, width * height * 3);
  else {
    rgb = new Uint8Array(width * height * 3);
    for (let p = 0, q = 0; q < rgb.length; p += 4, q += 3) {
      rgb[q] = rgba[p];
      rgb[q + 1] = rgba[p + 1];
      rgb[q + 2] = rgba[p + 2];
    }
  }
  const sha256 = createHash('sha256').update(`${height}x${width}\n`).update(rgb).digest('hex');
  return { height, width, rgb, sha256 };
}

/** The model families whose processors src/tokenize/images.ts follows. */
export const VL_FAMILIES = ['qwen2_vl', 'qwen2_5_vl', 'qwen3_vl'] as const;
export type VlFamily = (typeof VL_FAMILIES)[number];

/** A processor's settings: what the micro-batch header carries as `image_processor` (docs/reference/format.md). */
export interface ImageProcessor {
  family: VlFamily;
  patch_size: number;
  merge_size: number;
  temporal_patch_size: number;
  min_pixels: number;
  max_pixels: number;
  image_token_id: number;
  vision_start_token_id: number;
  vision_end_token_id: number;
  /** Pixel normalisation of the vision tower (the trainer resizes and normalises the RGB bytes itself). */
  image_mean?: number[];
  image_std?: number[];
  rescale_factor?: number;
  /** PIL resampling filter of the resize (3 = bicubic). */
  resample?: number;
}

/** An image with what the processor makes of it: its identity, its patch grid and its placeholder count. */
export interface ProcessedImage extends DecodedImage {
  /** sha256 hex of the decoded bytes and the processor settings: the image's identity in the forest. */
  hash: string;
  /** (t, h, w) in patches, the processor's `image_grid_thw` */
  grid: [number, number, number];
  /** placeholder tokens: t·h·w / merge_size² */
  tokens: number;
  /** the settings it was processed with */
  processor: ImageProcessor;
}

/** Where an image's placeholders lie in a token sequence: tokens [start, start + image.tokens). */
export interface ImageSpan {
  start: number;
  image: ProcessedImage;
}
