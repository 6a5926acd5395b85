#!/usr/bin/env python3
"""Build the KJV corpus and train the tiny Step byte-level BPE tokenizer.

Usage: make_tokenizer.py OUT_DIR CORPUS_DIR

Writes OUT_DIR/tokenizer.json, OUT_DIR/tokenizer_config.json and
CORPUS_DIR/{train,heldout}.txt.  Deterministic for a given bible-kjv-text.
"""
import json
import os
import re
import subprocess
import sys

from tokenizers import Tokenizer, Regex, decoders, models, pre_tokenizers, trainers

VOCAB_TRAIN = 4000          # tokens actually produced by BPE (incl. specials)
# Specials, in id order (docs/MODEL.md §7; ids 0.. are fixed, other engineers rely on them).
SPECIALS = [
    "<｜begin▁of▁sentence｜>",  # 0 BOS
    "<|im_start|>",              # 1
    "<|im_end|>",                # 2  (EOS of chat turns)
    "<think>",                   # 3
    "</think>",                  # 4
    "<｜end▁of▁sentence｜>",    # 5  EOS of plain text
    "<tool_call>",               # 6
    "</tool_call>",              # 7
    "<tool_response>",           # 8
    "</tool_response>",          # 9
]
BOS_ID = 0
EOS_IDS = [5, 2]

# DeepSeek-V3 style pre-tokenizer split (the C tokenizer reads these from tokenizer.json).
SPLIT_PATTERNS = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]

# Step-3.7 chat template (docs/MODEL.md §7): one source of truth shared with the C renderer's
# byte-for-byte tests (common/tok/chat.c, test/tok/check_template.py).
CHAT_TEMPLATE = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "test", "tok",
                                  "data", "step37_chat_template.jinja")).read()


def kjv_chapters():
    """Return [(header, [verse, ...]), ...] for the whole KJV from the `bible` tool."""
    raw = subprocess.run(["bible", "Gen1:1-Rev22:21"], check=True, capture_output=True,
                         text=True).stdout
    chapters = []
    verse = None
    for line in raw.split("\n"):
        m = re.match(r"^  ?\s*(\d+) (.*)$", line)
        if line.strip() == "":
            continue
        if m and line.startswith(" "):
            if verse is not None:
                chapters[-1][1].append(verse)
            verse = m.group(2).strip()
        elif not line.startswith(" ") and re.match(r"^[1-3]? ?[A-Z][A-Za-z ]+ \d+$", line):
            if verse is not None:
                chapters[-1][1].append(verse)
                verse = None
            chapters.append((line.strip(), []))
        else:
            verse = (verse + " " + line.strip()) if verse is not None else line.strip()
    if verse is not None:
        chapters[-1][1].append(verse)
    return chapters


def chapter_text(header, verses):
    return header + "\n\n" + "\n".join(verses) + "\n\n"


def main():
    out_dir, corpus_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    os.makedirs(corpus_dir, exist_ok=True)
    chapters = kjv_chapters()
    assert len(chapters) == 1189, len(chapters)
    train, held = [], []
    for i, (h, v) in enumerate(chapters):
        (held if i % 50 == 25 else train).append(chapter_text(h, v))
    with open(os.path.join(corpus_dir, "train.txt"), "w") as f:
        f.write("".join(train))
    with open(os.path.join(corpus_dir, "heldout.txt"), "w") as f:
        f.write("".join(held))

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in SPLIT_PATTERNS]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_TRAIN, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(train, trainer=trainer)
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    tok.save(os.path.join(out_dir, "tokenizer.json"))

    tcfg = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": SPECIALS[BOS_ID],
        "eos_token": "<|im_end|>",
        "pad_token": SPECIALS[5],
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "legacy": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {str(i): {"content": s, "lstrip": False, "normalized": False,
                                          "rstrip": False, "single_word": False, "special": True}
                                 for i, s in enumerate(SPECIALS)},
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tcfg, f, indent=2, ensure_ascii=False)
        f.write("\n")
    print("vocab", tok.get_vocab_size(), "train chars", sum(map(len, train)),
          "heldout chars", sum(map(len, held)))


if __name__ == "__main__":
    main()
