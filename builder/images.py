"""Decoding source images into the RGB pictures every stage sees, and encoding release images.

Unusual but valid images are converted faithfully (EXIF orientation, CMYK, 16-bit, palette, alpha, grayscale);
images that cannot be used raise ``ImageDecodeError`` with a reason that the builder records as a per-sample failure
(zero-byte, truncated, not an image, too small, too large). Encoding is deterministic: the same pixels always give the
same bytes, which is what makes rebuilt shards byte-identical.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError


class ImageDecodeError(ValueError):
    """A source image that cannot be used; the message is the recorded failure reason."""


def _to_8bit(img: Image.Image) -> Image.Image:
    """High-bit-depth grayscale ("I;16*", "I", "F") to 8-bit "L", scaling rather than clipping."""
    arr = np.asarray(img)
    if img.mode.startswith("I;16") or (img.mode == "I" and arr.max(initial=0) > 255):
        scaled = np.clip(np.round(arr.astype(np.float64) / 257.0), 0, 255)
    elif img.mode == "F":
        scaled = np.clip(np.round(arr.astype(np.float64) * (255.0 if arr.max(initial=0) <= 1.0 else 1.0)), 0, 255)
    else:
        scaled = np.clip(arr, 0, 255)
    return Image.fromarray(scaled.astype(np.uint8), mode="L")


def _flatten_alpha(img: Image.Image) -> Image.Image:
    """Composite transparent images on white, the usual rendering of a transparent photo."""
    rgba = img.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def to_rgb(img: Image.Image) -> Image.Image:
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        img = _to_8bit(img)
    if img.mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    if img.mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        return _flatten_alpha(img)
    if img.mode == "L" and "transparency" in img.info:
        return _flatten_alpha(img.convert("LA"))
    return img.convert("RGB")


def decode_image(
    data: bytes,
    *,
    image_size: int | None,
    min_side: int = 16,
    max_pixels: int = 89_478_485,
) -> Image.Image:
    """Bytes of any image file to an RGB picture, centre-cropped and resized to ``image_size`` if given.

    The crop-and-resize follows the authors' ``load_512`` (centre square, then resize), so that the original, the
    reconstruction and the counterfactuals of a sample are pixel-aligned.
    """
    if not data:
        raise ImageDecodeError("zero-byte file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            width, height = img.size
            if width * height > max_pixels:
                raise ImageDecodeError(f"image too large: {width}x{height} exceeds {max_pixels} pixels")
            img.load()
    except ImageDecodeError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ImageDecodeError(f"image too large: {err}") from err
    except UnidentifiedImageError as err:
        raise ImageDecodeError("not an image: the file's contents are not a format Pillow can read") from err
    except (OSError, SyntaxError, ValueError, EOFError) as err:
        raise ImageDecodeError(f"truncated or corrupt image: {err}") from err
    try:
        img = ImageOps.exif_transpose(img)
        img = to_rgb(img)
    except (OSError, ValueError) as err:
        raise ImageDecodeError(f"cannot convert image (mode {img.mode}) to RGB: {err}") from err
    if min(img.size) < min_side:
        raise ImageDecodeError(f"image too small: {img.size[0]}x{img.size[1]}, the shorter side must be >= {min_side}")
    if image_size is not None:
        img = ImageOps.fit(img, (image_size, image_size), method=Image.Resampling.BICUBIC, centering=(0.5, 0.5))
    return img


def encode_image(img: Image.Image, image_format: str) -> bytes:
    """Deterministic lossless encoding of an RGB image for a release shard."""
    if img.mode != "RGB":
        img = img.convert("RGB")
    buf = io.BytesIO()
    if image_format == "png":
        img.save(buf, format="PNG", compress_level=6, optimize=False)
    elif image_format == "webp":
        img.save(buf, format="WEBP", lossless=True, quality=100, method=4, exact=True)
    else:
        raise ValueError(f"image format {image_format!r}: expected png or webp")
    return buf.getvalue()
