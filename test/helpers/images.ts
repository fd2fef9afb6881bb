/** Images for the image tests: generated PNG (bench/images.ts) and JPEG files, data URLs and content parts. */
import jpeg from 'jpeg-js';

export { png, vlTokenizerDir } from '../../bench/images.js';

/** A JPEG of height × width, a gradient. */
export function jpg(height: number, width: number): Buffer {
  const data = Buffer.alloc(width * height * 4);
  for (let i = 0; i < width * height; i++) data.set([i % 256, (i >> 3) % 256, 128, 255], 4 * i);
  return jpeg.encode({ data, width, height }, 90).data;
}

export const dataUrl = (bytes: Buffer, mime = 'image/png') => `data:${mime};base64,${bytes.toString('base64')}`;

export const imagePart = (url: string) => ({ type: 'image_url', image_url: { url } });
