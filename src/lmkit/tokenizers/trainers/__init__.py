"""`train_tokenizer`: a full pipeline (normalizer, pre-tokenizer, model, post-processor, decoder) per kind,
trained on any iterable of strings, saved as a tokenizer.json that Hugging Face `tokenizers` loads."""
from __future__ import annotations

import numbers
from collections import Counter

from lmkit.errors import TokenizerError
from lmkit.progress import progress_bar
from lmkit.tokenizers import decoders, normalizers, pre_tokenizers, processors
from lmkit.tokenizers.added_tokens import AddedToken
from lmkit.tokenizers.chars import BYTE_TO_CHAR
from lmkit.tokenizers.models import BPE, Unigram, WordLevel, WordPiece
from lmkit.tokenizers.tokenizer import Tokenizer
from lmkit.tokenizers.trainers.bpe import train_bpe
from lmkit.tokenizers.trainers.unigram import train_unigram
from lmkit.tokenizers.trainers.words import count_words

KINDS = ("bpe", "wordpiece", "unigram", "char", "word")
DEFAULT_SPECIALS = {
    "bpe": ["<|endoftext|>", "<|pad|>"],
    "wordpiece": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
    "unigram": ["<pad>", "</s>", "<unk>"],
    "char": ["[PAD]", "[UNK]", "[BOS]", "[EOS]"],
    "word": ["[PAD]", "[UNK]", "[BOS]", "[EOS]"],
}
UNK = {"wordpiece": "[UNK]", "unigram": "<unk>", "char": "[UNK]", "word": "[UNK]"}
ANY_CHAR = {"Regex": "[\\s\\S]"}


def _pipeline(kind: str, pattern: str, lowercase: bool):
    """(normalizer, pre_tokenizer, decoder) of an untrained tokenizer of this kind."""
    if kind == "bpe":
        if pattern == "gpt2":
            pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        elif pattern == "gpt4":
            pre = pre_tokenizers.Sequence([pre_tokenizers.Split({"Regex": pre_tokenizers.GPT4_PATTERN}, "Isolated"),
                                           pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        elif pattern == "digits":  # gpt2's, with every digit a piece of its own (LLaMA's split_digits): no merges of digits
            pre = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                           pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        elif pattern == "code":  # gpt2's, after runs of spaces and tabs are cut out whole (indentation tokens)
            pre = pre_tokenizers.Sequence([pre_tokenizers.Split({"Regex": pre_tokenizers.CODE_WHITESPACE}, "Isolated"),
                                           pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        else:
            raise TokenizerError(f"pattern must be 'gpt2', 'gpt4', 'digits' or 'code', not {pattern!r}")
        return None, pre, decoders.ByteLevel()
    if kind == "wordpiece":
        return (normalizers.BertNormalizer(lowercase=lowercase), pre_tokenizers.BertPreTokenizer(),
                decoders.WordPiece("##", cleanup=True))
    if kind == "unigram":
        return (normalizers.NFKC(), pre_tokenizers.Metaspace("\u2581", "always", True),
                decoders.Metaspace("\u2581", "always", True))
    if kind == "char":
        return None, pre_tokenizers.Split(ANY_CHAR, "Isolated"), decoders.Fuse()
    return None, pre_tokenizers.Whitespace(), None


def _post_processor(kind: str, specials: list[str], vocab_id) -> processors.PostProcessor | None:
    def special(name):
        return {"id": name, "ids": [vocab_id(name)], "tokens": [name]}
    if kind == "wordpiece" and "[CLS]" in specials and "[SEP]" in specials:
        return processors.bert_template("[CLS]", vocab_id("[CLS]"), "[SEP]", vocab_id("[SEP]"))
    if kind == "unigram" and "</s>" in specials:
        return processors.TemplateProcessing(["$A:0", "</s>:0"], ["$A:0", "</s>:0", "$B:1", "</s>:1"],
                                             {"</s>": special("</s>")})
    return None


def _check_floor(kind: str, vocab_size: int, floor: int) -> None:
    """The vocabulary before any merge (special tokens + alphabet, and for WordPiece its ##-forms) must fit."""
    if vocab_size < floor:
        raise TokenizerError(f"vocab_size {vocab_size} is below the {floor} ids the {kind} special tokens and "
                             f"alphabet take before any merge; use vocab_size >= {floor} (--vocab-size)")


def train_tokenizer(texts, kind: str = "bpe", vocab_size: int = 8000, special_tokens=None, *,
                    pattern: str = "gpt2", lowercase: bool = True, min_frequency: int = 0,
                    show_progress: bool = False, num_workers: int | None = None) -> Tokenizer:
    """Train a tokenizer of `kind` ("bpe" byte-level, "wordpiece", "unigram", "char", "word") on `texts`.

    special_tokens: list of strings (default per kind, e.g. `[PAD] [UNK] [CLS] [SEP] [MASK]` for WordPiece);
    they take the first ids and are never split. pattern: "gpt2", "gpt4", "digits" (gpt2's with each digit
    alone) or "code" (gpt2's with runs of spaces and tabs kept whole) pre-tokenization for BPE.
    """
    if kind not in KINDS:
        raise TokenizerError(f"unknown tokenizer kind {kind!r}; use one of {', '.join(KINDS)}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral) or vocab_size <= 0:
        raise TokenizerError(f"vocab_size must be a positive integer, not {vocab_size!r}")
    vocab_size = int(vocab_size)
    specials = list(DEFAULT_SPECIALS[kind] if special_tokens is None else special_tokens)
    if kind in UNK and UNK[kind] not in specials:  # Unigram: id 0, where `tokenizers` puts it
        specials.insert(0 if kind == "unigram" else len(specials), UNK[kind])
    if len(set(specials)) != len(specials):
        raise TokenizerError(f"special_tokens has duplicates: {specials}")
    if vocab_size < len(specials):
        raise TokenizerError(f"vocab_size {vocab_size} cannot hold the {len(specials)} special tokens {specials}; "
                             f"use vocab_size >= {len(specials)}")
    if kind == "bpe":  # the byte alphabet is known before counting: fail before any work
        _check_floor(kind, vocab_size, len(set(specials) | set(BYTE_TO_CHAR.values())))
    normalizer, pre, decoder = _pipeline(kind, pattern, lowercase)
    added = [AddedToken(t, i, special=True) for i, t in enumerate(specials)]
    # as `tokenizers`' train_from_iterator: special tokens written in the text are counted as ordinary text
    probe = Tokenizer(WordLevel({t: i for i, t in enumerate(specials)}, None), normalizer, pre, None, decoder, [])
    word_counts = count_words(probe, texts, num_workers)
    if not word_counts:
        raise TokenizerError("no text to train on: the corpus is empty (or only whitespace); pass some text")
    bar = None
    if show_progress:
        bar = progress_bar(total=vocab_size, desc=f"train {kind}", unit="tok")
    try:
        model = _train_model(kind, word_counts, vocab_size, specials, min_frequency, bar)
        if bar is not None:
            bar.update(max(0, len(model.vocab) - bar.n))
    finally:
        if bar is not None:
            bar.close()  # also before an error, so that the CLI's one-line message is a line of its own
    post = _post_processor(kind, specials, model.token_to_id)
    return Tokenizer(model, normalizer, pre, post, decoder, added)


def _train_model(kind: str, word_counts, vocab_size: int, specials: list[str], min_frequency, bar):
    """The trained model (BPE, WordPiece, Unigram or WordLevel) of `kind` over the counted words."""
    if kind in ("bpe", "wordpiece"):
        if bar is not None:
            bar.update(len(specials) + (256 if kind == "bpe" else 0))
        vocab, merges = train_bpe(
            word_counts, vocab_size, specials,
            initial_alphabet=BYTE_TO_CHAR.values() if kind == "bpe" else (),
            min_frequency=min_frequency, limit_alphabet=1000 if kind == "wordpiece" else None,
            continuing_subword_prefix="##" if kind == "wordpiece" else None,
            progress=bar.update if bar is not None else None)
        _check_floor(kind, vocab_size, len(vocab) - len(merges))  # `tokenizers` would return a bigger vocab
        return BPE(vocab, merges) if kind == "bpe" else WordPiece(vocab, "[UNK]", "##", 100)
    if kind == "unigram":
        def report(n):
            if bar is not None:
                bar.set_postfix(pieces=n)
        pieces, unk_id = train_unigram(word_counts, vocab_size, specials, UNK[kind], progress=report)
        return Unigram(pieces, unk_id)
    counts: Counter = Counter()
    for w, c in word_counts.items():
        counts[w] += c
    ranked = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if w not in specials]
    vocab = {t: i for i, t in enumerate(specials)}
    for w in ranked[:max(0, vocab_size - len(vocab))]:
        if min_frequency and counts[w] < min_frequency:
            break
        vocab[w] = len(vocab)
    return WordLevel(vocab, UNK[kind])
