"""Offline tokenizers for the tiny pipelines: CLIP (BPE), T5 (Unigram) vocabularies generated from a word list.

Real checkpoints ship their tokenizers; the tiny pipelines cannot download any, so we generate small
ones whose files `save_pretrained`/`from_pretrained` treat exactly like the real ones.
"""
from __future__ import annotations

import string

# Words of every built-in prompt list, plus a few fillers; anything else falls back to characters.
WORDS = (
    "a an the of in on with and image picture photo that is all red green blue yellow white black "
    "colour color cat dog sky sea tree house car video clip moving scene bright dark"
).split()
CHARACTERS = string.ascii_lowercase + string.digits + ".,!?'-"


def clip_tokenizer(max_length: int):
    """A CLIPTokenizer over whole words (via BPE merges) and single characters."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    merges = []
    for word in WORDS:  # merge left to right: "r e", "re d</w>"
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        while len(pieces) > 1:
            merges.append((pieces[0], pieces[1]))
            pieces = [pieces[0] + pieces[1]] + pieces[2:]
            vocab.setdefault(pieces[0], len(vocab))
    merges = list(dict.fromkeys(merges))
    tok = CLIPTokenizer(vocab=vocab, merges=merges)
    tok.model_max_length = max_length  # DESIGN.md section 7: tokenizers need an explicit model_max_length
    return tok


def t5_tokenizer(max_length: int):
    """A T5Tokenizer (Unigram) over whole words and single characters, no sentinel tokens."""
    from transformers import T5Tokenizer

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -1.0) for w in WORDS]
    vocab += [(c, -5.0) for c in CHARACTERS]
    tok = T5Tokenizer(vocab=vocab, extra_ids=0)
    tok.model_max_length = max_length
    return tok


def vocab_size(tokenizer) -> int:
    return len(tokenizer)
