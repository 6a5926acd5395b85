"""image_ref.py - an independent numpy + PIL implementation of Step-3.7's image preprocessing,
written from the public processor (vLLM's step3_vl.py ImagePatcher / Step3VLProcessor, which
Step3p7ForConditionalGeneration inherits, and transformers' Step3VisionProcessor), to check
common/image/image.c against (test/unit/test_image.py).

What the reference does, and how this file computes it without torch:
  - the image is loaded with PIL and converted to RGB; RGBA is composited over white (vLLM's
    image loader), other modes use PIL's convert("RGB");
  - ImagePatcher: square-pad (black, top-left anchored) when the short side is < 32 and the
    aspect ratio > 4; scale a long side > 3024 down to 3024 (int() of the scaled sizes) with
    PIL's BILINEAR; pick the window; resize to multiples of the window with PIL's BILINEAR;
    cut the row-major grid of window x window crops with PIL's crop (black outside);
  - Step3VisionProcessor(728, "bilinear", 504): ToTensor, Normalize, Resize(antialias=True)
    on float tensors: here resize_aa(), the separable antialiased triangle filter in float64
    (the filter torchvision's antialiased bilinear and PIL's BILINEAR share), then rounded to
    uint8 for the comparison (the C side keeps views as uint8; normalisation is linear, so
    resizing before normalising is the same up to that rounding and the [0, 255] clamp);
  - the token layout of _get_image_repl_features: the crops' <patch_start> 81 x <im_patch>
    <patch_end> (+ <patch_newline> after each full row but the last), then <im_start>
    169 x <im_patch> <im_end>.

  python3 image_ref.py IMAGE      prints the grid, the token count and each view's mean
"""
import math
import sys

import numpy as np
from PIL import Image

GLOBAL, CROP, MAX_SIDE = 728, 504, 3024
GLOBAL_TOKENS, CROP_TOKENS = 169, 81
MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)


def load_rgb(path_or_image):
    img = path_or_image if isinstance(path_or_image, Image.Image) else Image.open(path_or_image)
    img.load()
    if img.mode == "RGB":
        return img
    if img.mode == "RGBA":
        out = Image.new("RGB", img.size, (255, 255, 255))
        out.paste(img, mask=img.split()[3])
        return out
    return img.convert("RGB")


def window_size(long, short):
    if long <= GLOBAL:
        return short if long / short > 1.5 else 0
    return min(short, CROP) if long / short > 4 else CROP


def crop_side(side, window):
    ratio = side / window
    if ratio < 1:
        return side
    frac = ratio - side // window
    return window * (int(ratio) + 1 if frac > 0.2 else int(ratio))


def grid(side, window):
    return 1 if side <= window else math.ceil((side - window) / window + 1)


def starts(side, window, n):
    s = [window * i for i in range(n)]
    if len(s) > 1 and s[-1] + window > side:
        s[-1] = side - window
    return s


def patch(img):
    """ImagePatcher: (the image for the global view, the crops, the newline mask, window, nx, ny)"""
    w, h = img.size
    if min(w, h) < 32 and (w / h > 4 or w / h < 1 / 4):
        side = max(w, h)
        padded = Image.new(img.mode, (side, side), 0)
        padded.paste(img, (0, 0))
        img = padded
        w, h = img.size
    if max(w, h) > MAX_SIDE:
        sf = MAX_SIDE / max(w, h)
        w, h = int(w * sf), int(h * sf)
        img = img.resize((w, h), Image.Resampling.BILINEAR)
    win = window_size(max(w, h), min(w, h))
    if win == 0:
        return img, [], [], 0, 0, 0
    cw, ch = crop_side(w, win), crop_side(h, win)
    src = img.resize((cw, ch), Image.Resampling.BILINEAR) if (cw, ch) != (w, h) else img
    nx, ny = grid(cw, win), grid(ch, win)
    crops, newline = [], []
    for i, (y, x) in enumerate((y, x) for y in starts(ch, win, ny) for x in starts(cw, win, nx)):
        crops.append(src.crop((x, y, x + win, y + win)))
        newline.append((i + 1) % nx == 0)
    if newline:
        newline[-1] = False
    return img, crops, newline, win, nx, ny


def aa_taps(n_in, n_out):
    """the antialiased triangle filter: per output, (first input, weights)"""
    scale = n_in / n_out
    fs = max(scale, 1.0)
    taps = []
    for o in range(n_out):
        c = (o + 0.5) * scale
        lo, hi = max(int(c - fs + 0.5), 0), min(int(c + fs + 0.5), n_in)
        wt = np.clip(1.0 - np.abs((np.arange(lo, hi) - c + 0.5) / fs), 0.0, None)
        taps.append((lo, wt / wt.sum()))
    return taps


def resize_axis(a, axis, n_out):
    if a.shape[axis] == n_out:      # scale 1: the filter's one non-zero tap is the pixel itself
        return a
    a = np.moveaxis(a, axis, 0)
    out = np.stack([np.tensordot(wt, a[lo:lo + len(wt)], axes=(0, 0)) for lo, wt in aa_taps(a.shape[0], n_out)])
    return np.moveaxis(out, 0, axis)


def resize_aa(rgb, out_w, out_h):
    """float64 [h, w, 3] -> [out_h, out_w, 3], no intermediate rounding"""
    return resize_axis(resize_axis(rgb, 1, out_w), 0, out_h)


def views(img):
    """(views as float64 [side, side, 3] in 0..255, token order; the token ids; grid)"""
    glob, crops, newline, win, nx, ny = patch(img)
    out = [resize_aa(np.asarray(c, dtype=np.float64), CROP, CROP) for c in crops]
    out.append(resize_aa(np.asarray(glob, dtype=np.float64), GLOBAL, GLOBAL))
    return out, newline, (win, nx, ny)


def tokens(n_crops, newline, ids):
    t = []
    for i in range(n_crops):
        t += [ids["patch_start"]] + [ids["im_patch"]] * CROP_TOKENS + [ids["patch_end"]]
        if newline[i]:
            t.append(ids["patch_newline"])
    return t + [ids["im_start"]] + [ids["im_patch"]] * GLOBAL_TOKENS + [ids["im_end"]]


def normalize(view):
    """what the encoder's first step computes from a uint8 view: [3, H, W] float32"""
    x = np.asarray(view, dtype=np.float32) / 255.0
    return ((x - np.array(MEAN, np.float32)) / np.array(STD, np.float32)).transpose(2, 0, 1)


if __name__ == "__main__":
    img = load_rgb(sys.argv[1])
    vs, nl, (win, nx, ny) = views(img)
    ids = dict(im_start=1, im_end=2, patch_start=3, patch_end=4, patch_newline=5, im_patch=6)
    print("size %dx%d window %d grid %dx%d tokens %d" % (img.size + (win, nx, ny, len(tokens(len(vs) - 1, nl, ids)))))
    for i, v in enumerate(vs):
        print("view %d: %dx%d mean %.3f" % (i, v.shape[1], v.shape[0], v.mean()))
