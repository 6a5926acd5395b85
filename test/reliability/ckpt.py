"""ckpt.py - build malformed copies of a safetensors checkpoint directory (test helper)."""
import json
import os
import shutil
import struct


def read_st(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
        data = f.read()
    return hdr, data


def write_st(path, hdr, data):
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.write(data)


def copy_model(src, dst):
    """A writable copy of src (the shards are hard-linked only when unmodified, so copy)."""
    shutil.copytree(src, dst, symlinks=True)
    return dst


def index_path(d):
    return os.path.join(d, "model.safetensors.index.json")


def load_index(d):
    with open(index_path(d)) as f:
        return json.load(f)


def save_index(d, ix):
    with open(index_path(d), "w") as f:
        json.dump(ix, f, indent=1)


def shard_of(d, tensor):
    return load_index(d)["weight_map"][tensor]


def remove_tensor(d, tensor):
    """Drop `tensor` from its shard (data repacked, offsets stay contiguous) and from the index."""
    ix = load_index(d)
    shard = ix["weight_map"].pop(tensor)
    path = os.path.join(d, shard)
    hdr, data = read_st(path)
    meta = hdr.pop("__metadata__", None)
    del hdr[tensor]
    out = bytearray()
    for name, t in sorted(hdr.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        b, e = t["data_offsets"]
        t["data_offsets"] = [len(out), len(out) + (e - b)]
        out += data[b:e]
    if meta is not None:
        hdr["__metadata__"] = meta
    write_st(path, hdr, bytes(out))
    save_index(d, ix)
    return shard


def add_tensor(d, tensor, dtype, shape, payload):
    """Append `tensor` (raw little-endian bytes) to the first shard and the index."""
    ix = load_index(d)
    shard = sorted(set(ix["weight_map"].values()))[0]
    path = os.path.join(d, shard)
    hdr, data = read_st(path)
    hdr[tensor] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(data), len(data) + len(payload)]}
    write_st(path, hdr, data + payload)
    ix["weight_map"][tensor] = shard
    save_index(d, ix)


def set_dtype(d, tensor, dtype):
    """Change the header dtype of `tensor` in place (same byte size keeps offsets valid)."""
    path = os.path.join(d, shard_of(d, tensor))
    hdr, data = read_st(path)
    hdr[tensor]["dtype"] = dtype
    write_st(path, hdr, data)


def set_header_len(path, n):
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", n))


def truncate(path, nbytes_off):
    sz = os.path.getsize(path)
    os.truncate(path, sz - nbytes_off)
