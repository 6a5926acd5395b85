#!/usr/bin/env python3
"""check_tokenizer.py - live cross-check of stepd's C tokenizer against the `tokenizers` library.

The corpus is written by the C tool (tok-cli corpus) so both sides see identical bytes; this
script encodes every document and decodes every random id sequence with `tokenizers`, builds
the same digest lines as tok-cli digest / test-tok-equality, and compares them.  On a mismatch
it prints the first differing ids.  --write FILE stores the digest lines as the committed
expected file.  --bench also times both encoders in the same run (MB/s).

usage: check_tokenizer.py --cli build/test/tok/tok-cli --tokenizer T.json [--write F] [--bench]
"""
import argparse
import subprocess
import sys
import tempfile
import time

try:
    from tokenizers import Tokenizer
except ImportError:
    print('SKIP: the tokenizers library is not installed')
    sys.exit(77)


def fnv64(data: bytes) -> int:
    h = 0xcbf29ce484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h



def fnv64_ids(ids) -> int:
    import struct
    return fnv64(struct.pack('<%di' % len(ids), *ids))


def read_corpus(path):
    docs, seqs = [], []
    with open(path, 'rb') as f:
        data = f.read()
    i = 0
    while i < len(data):
        nl = data.index(b'\n', i)
        head = data[i:nl].decode().split()
        if head[0] == 'doc':
            n = int(head[3])
            docs.append((head[1], int(head[2]), data[nl + 1:nl + 1 + n].decode('utf-8')))
            i = nl + 1 + n + 1
        else:
            end = data.index(b'\n', nl + 1)
            seqs.append((int(head[1]), [int(x) for x in data[nl + 1:end].split()]))
            i = end + 1
    return docs, seqs


def digest_lines(tok, docs, seqs):
    lines = []
    for part, idx, text in docs:
        ids = tok.encode(text, add_special_tokens=False).ids
        lines.append('%s %d %d %016x' % (part, idx, len(ids), fnv64_ids(ids)))
        if part == 'synth' and idx % 4 == 0:
            tok.encode_special_tokens = True
            ids = tok.encode(text, add_special_tokens=False).ids
            tok.encode_special_tokens = False
            lines.append('synth-plain %d %d %016x' % (idx, len(ids), fnv64_ids(ids)))
    for idx, ids in seqs:
        text = tok.decode(ids, skip_special_tokens=False).encode('utf-8')
        lines.append('decode %d %d %016x' % (idx, len(text), fnv64(text)))
    return lines


def first_diff(tok, cli, tokpath, docs, part, idx):
    for p, i, text in docs:
        if p == part.replace('-plain', '') and i == idx:
            ref = tok.encode(text, add_special_tokens=False).ids
            out = subprocess.run([cli, 'encode', tokpath], input=text.encode(),
                                 capture_output=True, check=True).stdout.split()
            ours = [int(x) for x in out]
            for k, (a, b) in enumerate(zip(ref, ours)):
                if a != b:
                    print('  first difference at token %d: tokenizers %s vs ours %s' %
                          (k, ref[max(0, k - 3):k + 4], ours[max(0, k - 3):k + 4]))
                    print('  tokens: %r vs %r' % ([tok.id_to_token(x) for x in ref[k:k + 3]],
                                                  [tok.id_to_token(x) for x in ours[k:k + 3]]))
                    return
            print('  lengths differ: %d vs %d' % (len(ref), len(ours)))
            return


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--cli', required=True)
    ap.add_argument('--tokenizer', required=True)
    ap.add_argument('--write')
    ap.add_argument('--bench', action='store_true')
    a = ap.parse_args()

    if not a.tokenizer:
        print('SKIP: no tokenizer.json given (the PyPI one comes with anthropic==0.34.2, '
              'tools/dev/install-deps.sh)')
        sys.exit(77)
    tok = Tokenizer.from_file(a.tokenizer)
    with tempfile.NamedTemporaryFile(suffix='.corpus') as tf:
        subprocess.run([a.cli, 'corpus', a.tokenizer, tf.name], check=True)
        docs, seqs = read_corpus(tf.name)
    nbytes = sum(len(t.encode()) for _, _, t in docs)
    print('corpus: %d documents, %d bytes (%s), %d decode sequences' %
          (len(docs), nbytes, ', '.join(sorted({p for p, _, _ in docs})), len(seqs)))
    ref = digest_lines(tok, docs, seqs)
    ours = subprocess.run([a.cli, 'digest', a.tokenizer], capture_output=True, check=True,
                          text=True).stdout.splitlines()
    bad = [(r, o) for r, o in zip(ref, ours) if r != o]
    if len(ref) != len(ours):
        print('MISMATCH: %d reference lines vs %d ours' % (len(ref), len(ours)))
    for r, o in bad[:10]:
        print('MISMATCH tokenizers: %s\n         ours:       %s' % (r, o))
        part, idx = r.split()[0], int(r.split()[1])
        if part != 'decode':
            first_diff(tok, a.cli, a.tokenizer, docs, part, idx)
    ok = not bad and len(ref) == len(ours)
    n_tok = sum(int(l.split()[2]) for l in ref if not l.startswith('decode'))
    print('%s: %d digest lines, %d tokens compared, %d mismatches' %
          ('OK' if ok else 'FAIL', len(ref), n_tok, len(bad)))
    if a.write and ok:
        raw = open(a.tokenizer, 'rb').read()
        with open(a.write, 'w') as f:
            f.write('# tokenizer %016x %d\n' % (fnv64(raw), len(raw)))
            f.write('\n'.join(ref) + '\n')
        print('wrote', a.write)
    if a.bench:
        texts = [t for _, _, t in docs]
        t0 = time.perf_counter()
        for t in texts:
            tok.encode(t, add_special_tokens=False)
        dt = time.perf_counter() - t0
        print('tokenizers %s encode (1 thread): %d bytes in %.3f s = %.2f MB/s' %
              (__import__('tokenizers').__version__, nbytes, dt, nbytes / dt / 1e6))
        t0 = time.perf_counter()
        tok.encode_batch(texts, add_special_tokens=False)
        dt = time.perf_counter() - t0
        print('tokenizers encode_batch (all cores): %.2f MB/s' % (nbytes / dt / 1e6))
        print(subprocess.run([a.cli, 'bench', a.tokenizer], capture_output=True, check=True,
                             text=True).stdout, end='')
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
