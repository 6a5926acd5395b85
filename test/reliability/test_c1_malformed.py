#!/usr/bin/env python3
"""C1/C3/B12 through the real load path: malformed copies of models/tiny-step given to
`stepd-worker`.

Each case is a copy of the tiny model with one defect (truncated shard, header length
past the cap, a header length that points past the end of the file, a required tensor
removed, a wrong dtype, a wrong shape, an index entry escaping the directory, a shard
symlinked outside, an index naming a missing shard, a header that is not JSON).
Offline (`--rendezvous-dir ... --generate`): the worker must exit non-zero, never by a
crash signal, and its log must name the file and (where the defect is a tensor's) the
tensor.  With a coordinator: the worker exits non-zero, the coordinator stays up, its
readiness stays NOT_SERVING the whole time, the group is reported FAILED and the
coordinator's log carries the cause.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time

import rellib
from rellib import h
import ckpt

rellib.need_worker()
rellib.need_model()

S1 = "model-00001-of-00002.safetensors"
S2 = "model-00002-of-00002.safetensors"
T_DOWN = "model.layers.0.mlp.down_proj.weight"
T_NORM = "model.layers.0.input_layernorm.weight"


def mk_truncate(d):
    ckpt.truncate(os.path.join(d, S2), 100)
    return [S2, "truncated"]


def mk_hdr_cap(d):
    ckpt.set_header_len(os.path.join(d, S2), 1 << 40)
    return [S2, "header length"]


def mk_hdr_past_eof(d):
    p = os.path.join(d, S1)
    ckpt.set_header_len(p, os.path.getsize(p) - 4)   # under the cap, past the end of the file
    return [S1]


def mk_hdr_garbage(d):
    p = os.path.join(d, S1)
    with open(p, "r+b") as f:
        f.seek(8)
        f.write(b"\xff\xfe[not json")
    return [S1]


def mk_remove(d):
    ckpt.remove_tensor(d, T_DOWN)
    return [T_DOWN, "missing"]


def mk_dtype(d):
    ckpt.set_dtype(d, T_NORM, "F16")                  # same size, wrong type
    return [S1, T_NORM, "F16"]


def mk_dtype_int(d):
    ckpt.set_dtype(d, T_DOWN, "I16")
    return [S1, T_DOWN, "I16"]


def mk_shape(d):
    path = os.path.join(d, S1)
    hdr, data = ckpt.read_st(path)
    hdr[T_DOWN]["shape"] = [768, 256]                 # same element count, transposed
    ckpt.write_st(path, hdr, data)
    return [S1, T_DOWN]


def mk_index_escape(d):
    outside = os.path.join(os.path.dirname(d), "outside.safetensors")
    shutil.copy(os.path.join(d, S2), outside)
    ix = ckpt.load_index(d)
    victim = None
    for k, v in ix["weight_map"].items():
        if v == S2:
            ix["weight_map"][k] = "../outside.safetensors"
            victim = victim or k
    ckpt.save_index(d, ix)
    return ["model.safetensors.index.json", "../outside.safetensors", victim]


def mk_index_abs(d):
    outside = os.path.join(os.path.dirname(d), "outside.safetensors")
    shutil.copy(os.path.join(d, S2), outside)
    ix = ckpt.load_index(d)
    for k, v in ix["weight_map"].items():
        if v == S2:
            ix["weight_map"][k] = outside
    ckpt.save_index(d, ix)
    return ["model.safetensors.index.json", outside]


def mk_symlink_out(d):
    outside = os.path.join(os.path.dirname(d), "outside.safetensors")
    shutil.copy(os.path.join(d, S2), outside)
    os.remove(os.path.join(d, S2))
    os.symlink(outside, os.path.join(d, S2))
    return [S2, "outside"]


def mk_missing_shard(d):
    ix = ckpt.load_index(d)
    ix["weight_map"][T_NORM] = "model-00003-of-00002.safetensors"
    ckpt.save_index(d, ix)
    return ["model-00003-of-00002.safetensors"]


CASES = [
    ("truncated-shard", mk_truncate),
    ("header-len-over-cap", mk_hdr_cap),
    ("header-len-past-eof", mk_hdr_past_eof),
    ("header-not-json", mk_hdr_garbage),
    ("tensor-removed", mk_remove),
    ("dtype-f16-for-bf16", mk_dtype),
    ("dtype-i16-for-bf16", mk_dtype_int),
    ("shape-transposed", mk_shape),
    ("index-dotdot-escape", mk_index_escape),
    ("index-absolute-path", mk_index_abs),
    ("shard-symlink-outside", mk_symlink_out),
    ("index-missing-shard", mk_missing_shard),
]


def make_case(root, fn):
    d = os.path.join(root, "model")
    shutil.rmtree(d, True)
    for f in os.listdir(root):
        if f.startswith("outside"):
            os.remove(os.path.join(root, f))
    ckpt.copy_model(rellib.MODEL_DIR, d)
    return d, fn(d)


def check_output(name, rc, out, needles):
    sig = rellib.crash_signal(rc)
    assert sig is None, "%s: worker died of %s:\n%s" % (name, sig, out)
    assert rc is not None and rc > 0, "%s: worker exit %r (want > 0):\n%s" % (name, rc, out)
    missing = [n for n in needles if n not in out]
    assert not missing, "%s: log does not name %r:\n%s" % (name, missing, out)
    assert "AddressSanitizer" not in out and "runtime error" not in out, out


def test_offline():
    root = tempfile.mkdtemp(prefix="rel-c1-")
    prompt = os.path.join(root, "prompt.txt")
    with open(prompt, "w") as f:
        f.write("1,2,3\n")
    try:
        for name, fn in CASES:
            d, needles = make_case(root, fn)
            t0 = time.time()
            p = subprocess.run([rellib.WORKER_BIN, "--rendezvous-dir", os.path.join(root, "rdv-" + name),
                                "--group", "g", "--rank", "0", "--world-size", "1", "--threads", "1",
                                "--model", d, "--generate", prompt, "--max-tokens", "2"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
            check_output(name, p.returncode, p.stdout, needles)
            err = [ln for ln in p.stdout.splitlines() if any(n in ln for n in needles)]
            print("   %-22s rc=%d %.2fs  %s" % (name, p.returncode, time.time() - t0, err[0][:150]))
    finally:
        shutil.rmtree(root, True)


def test_with_coordinator():
    root = tempfile.mkdtemp(prefix="rel-c1c-")
    try:
        s = h.Stepd()
        pid0 = s.proc.pid
        for name, fn in [("truncated-shard", mk_truncate), ("shard-symlink-outside", mk_symlink_out),
                         ("tensor-removed", mk_remove), ("dtype-f16-for-bf16", mk_dtype)]:
            d, needles = make_case(root, fn)
            log = os.path.join(root, name + ".log")
            with open(log, "w") as lf:
                w = subprocess.Popen([rellib.WORKER_BIN, "--coordinator", "127.0.0.1:%d" % s.ports["control"],
                                      "--group", "bad", "--rank", "0", "--world-size", "1", "--threads", "1",
                                      "--model", d, "--engine-listen", "unix:%s/%s.sock" % (root, name),
                                      *s.key_args()],
                                     stdout=lf, stderr=subprocess.STDOUT)
            states = set()
            end = time.time() + 60
            while w.poll() is None and time.time() < end:
                states.add(s.check("readiness"))
                time.sleep(0.02)
            if w.poll() is None:
                w.kill()
                w.wait()
                raise AssertionError("%s: worker still running after 60 s" % name)
            check_output(name, w.returncode, open(log).read(), needles)
            for _ in range(10):                                  # a little after the exit too
                states.add(s.check("readiness"))
                time.sleep(0.02)
            assert states == {h.NOT_SERVING}, (name, states)
            assert s.proc.poll() is None and s.proc.pid == pid0, "coordinator died on %s" % name
            assert s.check("liveness") == h.SERVING
            g = [g for g in s.admin.GetGroups(h.pb.GetGroupsRequest(), timeout=2).groups if g.group == "bad"]
            assert g and g[0].state in (h.pb.WORKER_STATE_FAILED, h.pb.WORKER_STATE_GONE), g
            info = s.inf.GetServerInfo(h.pb.GetServerInfoRequest(), timeout=2)
            assert info.groups_ready == 0, info
            assert needles[0] in s.read_log(), "coordinator log lacks the cause of %s" % name
            print("   %-22s worker rc=%d, readiness NOT_SERVING throughout, group %s" %
                  (name, w.returncode, h.pb.WorkerState.Name(g[0].state)))
        c = None
        try:
            list(s.inf.Generate(h.gen_request(), timeout=3))
        except h.grpc.RpcError as e:
            c = e.code()
        assert c == h.grpc.StatusCode.UNAVAILABLE, c
        assert s.stop() == 0
    finally:
        shutil.rmtree(root, True)


def test_degraded_serves():
    """Not malformed, degraded: the worker serves.  An MTP tensor missing with --mtp 3: every
    missing name logged, served without speculation.  KV-quantisation parameters of any shape
    or dtype (a q_scale per query head, a prob_scale of 7, an I32 k_scale): loaded past, with
    one summary warning."""
    import struct
    root = tempfile.mkdtemp(prefix="rel-c1d-")
    missing = ["model.layers.6.hnorm.weight", "model.layers.7.self_attn.k_norm.weight"]
    extra = [("model.layers.1.self_attn.q_scale", "F32", [8], struct.pack("<8f", *[1.0] * 8)),
             ("model.layers.2.self_attn.prob_scale", "BF16", [7], b"\x80\x3f" * 7),
             ("model.layers.0.self_attn.k_scale", "I32", [], struct.pack("<i", 3))]

    def mk_degraded(d):
        for t in missing:
            ckpt.remove_tensor(d, t)
        for name, dt, shape, payload in extra:
            ckpt.add_tensor(d, name, dt, shape, payload)
        return []
    try:
        s = h.Stepd()
        d, _ = make_case(root, mk_degraded)
        w = s.start_worker("deg", "--threads", "1", "--model", d, "--mtp", "3")
        try:
            s.wait_ready(1, timeout=60)
        finally:
            log = open(w.logpath).read()
        for t in missing:
            assert "MTP tensor missing: %s" % t in log, log
        assert "serving without speculation (the trunk only)" in log, log
        kvq = [ln for ln in log.splitlines() if "KV-quantisation" in ln]
        assert len(kvq) == 1 and "3 KV-quantisation parameters ignored" in kvq[0], kvq
        req = h.gen_request([1, 2, 3], 6)
        req.sampling_params.temperature = 0.0
        toks, _, finals, _ = h.collect(s.inf.Generate(req, timeout=30))
        assert len(toks) == 6 and finals[0].mtp.num_drafts == 0, finals
        mi = s.inf.GetModelInfo(h.pb.GetModelInfoRequest(), timeout=2)
        assert mi.max_num_speculative_tokens == 0, mi
        print("   MTP incomplete (%d tensors missing, each named) and 3 odd KV-quantisation parameters (one "
              "warning): ready, served 6 tokens without drafts" % len(missing))
        assert s.stop() == 0
        assert w.wait(20) == 0
    finally:
        shutil.rmtree(root, True)


h.run_tests([("c1-offline-malformed", test_offline), ("c1-coordinator-stays-not-serving", test_with_coordinator),
             ("c1-degraded-serves", test_degraded_serves)])
