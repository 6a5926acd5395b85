"""test_image.py - common/image against PIL and tools/reference/image_ref.py.

  test_image.py IMAGE_DUMP REFERENCE_DIR        (Debian's python3 with python3-pil, python3-numpy)

1. formats: PNG (RGB, RGBA, grey, grey+alpha, palette, 16-bit), JPEG (colour,
   grey, progressive), WebP (lossless, lossy, alpha), GIF decode to the same RGB as PIL + the
   reference's convert-to-RGB (exact; lossy WebP within 2 levels: PIL's libwebp may convert
   YUV->RGB with another filter), and the sha256 of the encoded bytes;
2. refusals: decompression bombs (declared sizes patched into the headers of real files:
   refused from the header, -E2BIG, "declares"), byte/pixel limits, corrupt and truncated data
   (-EBADMSG), unsupported types (-ENOTSUP), an empty file;
3. preprocessing vs the reference on 7 generated images (sizes, aspect ratios, crops with and
   without padding, the 3024 downscale, the < 32 square pad): the grid and the token layout
   exactly, every view within 1 level (max |C - reference|, the reference in float64 rounded).
"""
import hashlib
import io
import json
import os
import resource
import struct
import subprocess
import sys
import tempfile
import zlib

import numpy as np
from PIL import Image

DUMP, REFDIR = sys.argv[1], sys.argv[2]
sys.path.insert(0, REFDIR)
import image_ref  # noqa: E402

IDS = dict(im_start=1, im_end=2, patch_start=3, patch_end=4, patch_newline=5, im_patch=6)
TMP = tempfile.mkdtemp(prefix="test-image-")
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def picture(w, h, seed=0, mode="RGB"):
    """a smooth pattern with edges and some noise (resampling errors show on all three)"""
    rs = np.random.RandomState(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    r = 127 + 100 * np.sin(x / 17.0) * np.cos(y / 23.0)
    g = 255 * (x / max(w - 1, 1))
    b = np.where(((x // 37) + (y // 29)) % 2 == 0, 220, 30)
    a = np.stack([r, g, b], -1) + rs.normal(0, 12, (h, w, 3))
    img = Image.fromarray(np.clip(a, 0, 255).astype(np.uint8), "RGB")
    return img if mode == "RGB" else img.convert(mode)


def encode(img, fmt, **kw):
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def dump(data, name, limits=None, max_address_space=None):
    path = os.path.join(TMP, name)
    with open(path, "wb") as f:
        f.write(data)
    out = os.path.join(TMP, name + ".out")
    args = [DUMP, path, out] + ([str(v) for v in limits] if limits else [])
    limit = (lambda: resource.setrlimit(resource.RLIMIT_AS, (max_address_space,) * 2)) if max_address_space else None
    p = subprocess.run(args, capture_output=True, text=True, timeout=120, preexec_fn=limit)
    if p.returncode == 2:
        return None, p.stdout.strip()
    if p.returncode != 0:
        raise RuntimeError("%s: rc %d: %s" % (name, p.returncode, p.stderr))
    meta = json.load(open(out + ".json"))
    rgb = np.fromfile(out + ".decoded.rgb", np.uint8).reshape(meta["h"], meta["w"], 3)
    meta["views_rgb"] = [np.fromfile("%s.view%d.rgb" % (out, i), np.uint8).reshape(v["h"], v["w"], 3)
                         for i, v in enumerate(meta["views"])]
    return meta, rgb


# ---- 1. formats ----
base = picture(97, 61, seed=1)
rgba = base.copy()
rgba.putalpha(Image.fromarray((np.arange(97 * 61).reshape(61, 97) % 256).astype(np.uint8)))
la = base.convert("L")
la.putalpha(128)
grey16 = Image.fromarray((np.asarray(base.convert("L"), np.uint16) * 257), "I;16")
cases = [
    ("png-rgb", encode(base, "PNG"), base, 0),
    ("png-rgba", encode(rgba, "PNG"), rgba, 0),
    ("png-grey", encode(base.convert("L"), "PNG"), base.convert("L"), 0),
    ("png-grey-alpha", encode(la, "PNG"), la, 0),
    ("png-palette", encode(base.convert("P"), "PNG"), base.convert("P"), 0),
    ("jpeg", encode(base, "JPEG", quality=90), None, 0),
    ("jpeg-grey", encode(base.convert("L"), "JPEG"), None, 0),
    ("jpeg-progressive", encode(base, "JPEG", progressive=True), None, 0),
    ("webp-lossless", encode(base, "WEBP", lossless=True), base, 0),
    ("webp-lossy", encode(base, "WEBP", quality=80), None, 2),
    ("webp-alpha", encode(rgba, "WEBP", lossless=True), rgba, 0),
    ("gif", encode(base.convert("P"), "GIF"), base.convert("P"), 0),
]
for name, data, src, tol in cases:
    if data is None:
        continue
    meta, rgb = dump(data, name)
    check(meta is not None, "%s decodes (%s)" % (name, rgb if meta is None else "%dx%d" % (meta["w"], meta["h"])))
    if meta is None:
        continue
    want = np.asarray(image_ref.load_rgb(Image.open(io.BytesIO(data))), np.int16)
    diff = int(np.abs(rgb.astype(np.int16) - want).max())
    check(diff <= tol, "%s: pixels equal PIL's within %d (max |diff| %d)" % (name, tol, diff))
    check(meta["hash"] == hashlib.sha256(data).hexdigest(), "%s: sha256 of the encoded bytes" % name)
    check(meta["format"] == {"png": "PNG", "jpeg": "JPEG", "webp": "WebP", "gif": "GIF"}[name.split("-")[0]],
          "%s: format %s" % (name, meta["format"]))

# 16-bit grey PNG: the high byte (PIL gives mode I;16 -> its own scaling; compare with >> 8)
meta, rgb = dump(encode(grey16, "PNG"), "png-grey16")
check(meta is not None and np.array_equal(rgb[:, :, 0], (np.asarray(grey16) >> 8).astype(np.uint8)),
      "png-grey16: 16-bit samples decode to their high byte")
# GIF first frame of an animation
frames = [picture(40, 30, seed=s).convert("P") for s in (3, 4)]
buf = io.BytesIO()
frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=100)
meta, rgb = dump(buf.getvalue(), "gif-animated")
want = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
check(meta is not None and np.array_equal(rgb, want), "gif-animated: the first frame")


# ---- 2. refusals ----
def refused(data, name, errno_name, needle, limits=None):
    meta, msg = dump(data, name, limits)
    check(meta is None and msg.startswith("refused " + errno_name) and needle in msg,
          "%s refused with %s naming '%s' (%s)" % (name, errno_name, needle, msg))


def png_with_size(data, w, h):
    ihdr = bytearray(data[8:33])   # length, 'IHDR', 13 bytes, crc
    ihdr[8:16] = struct.pack(">II", w, h)
    ihdr[21:25] = struct.pack(">I", zlib.crc32(bytes(ihdr[4:21])))
    return data[:8] + bytes(ihdr) + data[33:]


def jpeg_with_size(data, w, h):
    i = 2
    while i < len(data):
        marker, seg = data[i + 1], struct.unpack(">H", data[i + 2:i + 4])[0]
        if marker in (0xC0, 0xC1, 0xC2):
            return data[:i + 5] + struct.pack(">HH", h, w) + data[i + 9:]
        i += 2 + seg
    raise RuntimeError("no SOF")


png = encode(base, "PNG")
jpg = encode(base, "JPEG")
gif = encode(base.convert("P"), "GIF")
webp = encode(base, "WEBP", lossless=True)
refused(png_with_size(png, 100000, 100000), "bomb-png", "E2BIG", "declares 100000x100000")
refused(png_with_size(png, 3000000, 1), "bomb-png-libpng-max", "E2BIG", "declares 3000000x1")
refused(png_with_size(png, 10000, 10000), "bomb-png-pixels", "E2BIG", "declares 10000x10000 = 100000000 pixels")
refused(jpeg_with_size(jpg, 60000, 60000), "bomb-jpeg", "E2BIG", "declares 60000x60000")
refused(gif[:6] + struct.pack("<HH", 65535, 65535) + gif[10:], "bomb-gif", "E2BIG", "declares 65535x65535")
refused(webp, "limit-webp-pixels", "E2BIG", "= 5917 pixels, more than the limit of 5000", limits=(1 << 20, 16384, 5000))
refused(webp, "limit-webp-side", "E2BIG", "limit of 64 per side", limits=(1 << 20, 64, 1 << 30))
refused(png, "limit-bytes", "E2BIG", "more than the limit of 100", limits=(100, 16384, 1 << 30))
for name, data in (("png", png), ("jpeg", jpg), ("gif", gif), ("webp", webp)):
    refused(data[:len(data) // 2], "truncated-" + name, "EBADMSG", "corrupt or truncated")
    junk = bytearray(data)
    for k in range(len(junk) // 3, len(junk) - 4, 7):
        junk[k] ^= 0x5A
    if name == "webp":   # lossless WebP has no checksum: break its VP8L signature instead
        junk = bytearray(data)
        junk[20] ^= 0xFF
    refused(bytes(junk), "corrupt-" + name, "EBADMSG", "corrupt")
refused(encode(base, "BMP"), "unsupported-bmp", "EOPNOTSUPP", "unsupported image type")
refused(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "unsupported-svg", "EOPNOTSUPP", "unsupported image type")
refused(b"", "empty", "EBADMSG", "empty")


# ---- 3. preprocessing vs the reference ----
def layout_case(w, h, seed, expect_grid=None):
    img = picture(w, h, seed=seed)
    meta, _ = dump(encode(img, "PNG"), "prep-%dx%d" % (w, h))
    ref_views, newline, (win, nx, ny) = image_ref.views(img)
    ref_tokens = image_ref.tokens(len(ref_views) - 1, newline, IDS)
    what = "%dx%d" % (w, h)
    check((meta["window"], meta["crops_x"], meta["crops_y"]) == (win, nx if win else 0, ny if win else 0),
          "%s: grid window %d %dx%d equals the reference's (%d %dx%d)" %
          (what, meta["window"], meta["crops_x"], meta["crops_y"], win, nx, ny))
    if expect_grid:
        check((win, nx, ny) == expect_grid, "%s: the reference's grid is the expected %s" % (what, expect_grid))
    check(meta["tokens"] == ref_tokens and meta["n_token_count"] == len(ref_tokens),
          "%s: token layout equals the reference's (%d tokens)" % (what, len(ref_tokens)))
    check(len(meta["views_rgb"]) == len(ref_views), "%s: %d views" % (what, len(ref_views)))
    for i, (c, r) in enumerate(zip(meta["views_rgb"], ref_views)):
        r8 = np.clip(np.rint(r), 0, 255)
        d = np.abs(c.astype(np.float64) - r8)
        check(c.shape == r8.shape and d.max() <= 1,
              "%s view %d (%dx%d): max |diff| %d, mean %.4f (tolerance 1)" %
              (what, i, c.shape[1], c.shape[0], d.max(), d.mean()))


layout_case(640, 480, 11, (0, 0, 0))        # no crops: the global view only
layout_case(1000, 300, 12, (504, 2, 1))     # crops 504 wide on a 300-high image (black below)
layout_case(1500, 1100, 13, (504, 3, 2))    # 3x2 crops, newline after the first row
layout_case(700, 300, 14, (300, 3, 1))      # long <= 728, ratio > 1.5: 300-pixel windows (7/3: 0.33 > 0.2 rounds up)
layout_case(1300, 250, 15, (250, 6, 1))     # ratio > 4: the short side; 1300/250 - 5 is 0.2000...2 in doubles: > 0.2
layout_case(3400, 1200, 16, (504, 6, 2))    # > 3024: scaled down first
layout_case(20, 200, 17, (0, 0, 0))         # short side < 32, ratio > 4: padded to a square
layout_case(4000, 20, 18, (504, 6, 6))      # padded to 4000 x 4000, scaled to 3024 in one pass: 6x6

# a 16384 x 1 image pads to a 16384^2 square (800 MB of RGB) before the 3024 downscale: done in
# one pass, it preprocesses within 256 MiB of address space
# (not under ASan, whose shadow memory needs terabytes of address space: there without the limit)
asan = b"__asan_init" in open(DUMP, "rb").read()
meta, _ = dump(encode(Image.new("RGB", (16384, 1), (200, 100, 50)), "PNG"), "pad-16384x1",
               max_address_space=None if asan else 256 << 20)
check(meta is not None and meta["crops_x"] == 6 and meta["crops_y"] == 6,
      "16384x1: padded and scaled without materialising the square (%s)" %
      ("ASan build: no RLIMIT_AS" if asan else "RLIMIT_AS 256 MiB"))

# the token count formula against a range of sizes (no pixels)
for w, h in ((1, 1), (728, 728), (729, 485), (5000, 40), (3025, 3025), (504, 1200)):
    glob, crops, newline, win, nx, ny = image_ref.patch(Image.new("RGB", (w, h)))
    meta, _ = dump(encode(Image.new("RGB", (w, h), (10, 20, 30)), "PNG"), "count-%dx%d" % (w, h))
    check(meta["n_token_count"] == len(image_ref.tokens(len(crops), newline, IDS)),
          "%dx%d: token count %d equals the reference's" % (w, h, meta["n_token_count"]))

print("%d failure(s)" % len(failures))
sys.exit(1 if failures else 0)
