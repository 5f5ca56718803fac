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
    tok.model_max_length = max_length  # docs/DESIGN.md section 7: tokenizers need an explicit model_max_length
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


# --- byte-level BPE tokenizers (Qwen2, Llama 3) whose prompt-template prefix has a fixed token count -------------
# Qwen-Image and HunyuanVideo wrap the prompt in a chat template and drop a *fixed* number of leading tokens of the
# text encoder's output (Qwen: `prompt_template_encode_start_idx` = 34, Hunyuan: `crop_start` = 95), counted with
# the real tokenizers. A tiny tokenizer must therefore spend exactly that many tokens on the template prefix, or the
# crop eats the prompt (too many) or keeps template text (too few). `_fit_prefix` splits template-only words into two
# pieces until the count matches.


def _byte_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode table (what tokenizers' ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, codes)))


def _byte_level_bpe(specials: list[str], words: list[str], bare_words: list[str], split: set[str]):
    """vocab + merges: every byte, then " word" (and bare `word` for words that start a segment) built by
    left-to-right merges. Words in `split` stop one merge short (two tokens). Space-prefixed chains rank first,
    so the only merge available inside a " word" is the next step of its own chain."""
    table = _byte_unicode()
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in table.values():
        vocab.setdefault(ch, len(vocab))
    merges = [(table[10], table[10])]  # "\n\n" is one token, as in the real vocabularies
    vocab.setdefault(table[10] * 2, len(vocab))
    for prefix, group in ((" ", words), ("", bare_words)):
        for word in dict.fromkeys(group):
            pieces = [table[b] for b in (prefix + word).encode()]
            steps = len(pieces) - 1 - (1 if word in split else 0)
            for _ in range(steps):
                merges.append((pieces[0], pieces[1]))
                pieces = [pieces[0] + pieces[1]] + pieces[2:]
                vocab.setdefault(pieces[0], len(vocab))
    return vocab, list(dict.fromkeys(merges))


def _fit_prefix(build, prefix: str, target: int):
    """Build with a growing set of split template words until `prefix` tokenizes to exactly `target` tokens."""
    import re

    split: set[str] = set()
    count = lambda tok: len(tok(prefix)["input_ids"])  # noqa: E731
    tok = build(split)
    candidates = [w for w in dict.fromkeys(re.findall(r"[A-Za-z]+", prefix)) if w not in WORDS and len(w) > 1]
    for word in candidates:
        if count(tok) == target:
            break
        trial = build(split | {word})
        if count(trial) <= target:
            split, tok = split | {word}, trial
    if count(tok) != target:
        raise ValueError(f"tiny tokenizer spends {count(tok)} tokens on the template prefix, the pipeline drops {target}")
    return tok


def _template_words(text: str) -> tuple[list[str], list[str]]:
    """Words of the prompt vocabulary and of the template (as " word"), and the template's segment-initial words
    (bare `word`, no space before them: system, user, ...). Bare chains have no boundary marker, so they can break
    each other's merges; keeping them to these few avoids that for the two templates here (and `_fit_prefix` counts
    the result anyway). A prompt's first word is not space-prefixed and falls back to characters."""
    import re

    template = re.findall(r"[A-Za-z]+", text)
    bare = re.findall(r"(?:^|[\n>])([A-Za-z]+)", text)  # after a newline or a special token
    return WORDS + template, bare


def qwen2_tokenizer(max_length: int, template: str, prefix_tokens: int):
    """A Qwen2Tokenizer (byte-level BPE, Qwen's chat special tokens) for a prompt `template` ("...{}..."), whose
    part before "{}" is exactly `prefix_tokens` tokens."""
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    words, bare = _template_words(template.replace("{}", "\n"))

    def build(split):
        vocab, merges = _byte_level_bpe(specials, words, bare, split)
        return Qwen2Tokenizer(vocab=vocab, merges=merges, extra_special_tokens=specials[1:])

    tok = _fit_prefix(build, template.split("{}")[0], prefix_tokens)
    tok.model_max_length = max_length  # docs/DESIGN.md section 7: tokenizers need an explicit model_max_length
    return tok


def llama3_tokenizer(max_length: int, template: str, prefix_tokens: int):
    """A Llama-3-style fast tokenizer (byte-level BPE, <|begin_of_text|> prepended, right padding), as HunyuanVideo's
    llava-llama-3 text encoder uses; the part of `template` before "{}" (with BOS) is `prefix_tokens` tokens."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    words, bare = _template_words(template.replace("{}", "\n"))
    regex = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

    def build(split):
        vocab, merges = _byte_level_bpe(specials, words, bare, split)
        backend = Tokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=False))
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        backend.decoder = decoders.ByteLevel()
        backend.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", vocab["<|begin_of_text|>"])])
        return PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
            pad_token="<|end_of_text|>", extra_special_tokens=specials[2:], padding_side="right")

    tok = _fit_prefix(build, template.split("{}")[0], prefix_tokens)
    tok.model_max_length = max_length
    return tok
