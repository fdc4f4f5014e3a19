"""Tiny random folders as a Hub user finds them: a transformers model and a tokenizer trained in the family's style,
saved through the family's fast tokenizer class; and the CLI run in process."""
from __future__ import annotations

import pytest
import torch

from lmkit.cli import main

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402


TEXT = ["The quick brown fox jumps over the lazy dog.", "Hello world, this is a test of tokenizers.",
        "Python's with statement manages context.", "def f(x): return x * 2", "Numbers 12345 and 6789 here.",
        "A second line of text with some words repeated words repeated.", "café naïve résumé über",
        "transformers and tokenizers are libraries", "yield returns a generator object"] * 20


def byte_level_bpe(specials: list[str], vocab_size: int = 300):
    """GPT-2 / RoBERTa / BART / Qwen2 style: byte-level BPE."""
    t = tokenizers.Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return t


def spm_bpe(vocab_size: int = 400):
    """LLaMA / Mistral style: sentencepiece-like BPE with byte fallback, <unk> <s> </s>."""
    t = tokenizers.Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    t.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials))
    return t


def wordpiece(vocab_size: int = 300):
    """BERT / DistilBERT style: WordPiece with [CLS] [SEP] [MASK]."""
    t = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
    t.normalizer = normalizers.BertNormalizer(lowercase=True)
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    t.decoder = decoders.WordPiece()
    t.train_from_iterator(TEXT, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=[
        "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    return t


def unigram(specials: list[str], vocab_size: int = 200):
    """T5 style: Unigram with WhitespaceSplit + Metaspace, as transformers' converter writes it."""
    t = tokenizers.Tokenizer(models.Unigram())
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace()])
    t.decoder = decoders.Metaspace()
    t.train_from_iterator(TEXT, trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                        unk_token="<unk>"))
    return t


ROBERTA_SPECIALS = dict(bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>", unk_token="<unk>",
                        pad_token="<pad>", mask_token="<mask>")


DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)


def build(family: str, out) -> str:
    """A tiny random `family` folder as a Hub user finds it: model and tokenizer through save_pretrained."""
    T = transformers
    torch.manual_seed(0)
    if family == "gpt2":
        tok = T.GPT2TokenizerFast(tokenizer_object=byte_level_bpe(["<|endoftext|>"]), bos_token="<|endoftext|>",
                                  eos_token="<|endoftext|>", unk_token="<|endoftext|>")
        model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    elif family == "llama":
        tok = T.LlamaTokenizerFast(tokenizer_object=spm_bpe(), bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   add_bos_token=True)
        model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=len(tok), bos_token_id=1, eos_token_id=2, **DECODER))
    elif family == "qwen2":
        tok = T.Qwen2TokenizerFast(tokenizer_object=byte_level_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token=None, bos_token=None)
        model = T.Qwen2ForCausalLM(T.Qwen2Config(vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                                                 tie_word_embeddings=True, **DECODER))
    elif family == "distilbert":
        tok = T.DistilBertTokenizerFast(tokenizer_object=wordpiece(), unk_token="[UNK]", sep_token="[SEP]",
                                        pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")
        model = T.DistilBertForMaskedLM(T.DistilBertConfig(vocab_size=len(tok), dim=32, n_layers=2, n_heads=2,
                                                           hidden_dim=64, max_position_embeddings=64, pad_token_id=0))
    elif family == "t5":
        tok = T.T5TokenizerFast(tokenizer_object=unigram(["<pad>", "</s>", "<unk>"]), eos_token="</s>",
                                unk_token="<unk>", pad_token="<pad>", extra_ids=10)
        model = T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    elif family == "bart":
        tok = T.BartTokenizerFast(tokenizer_object=byte_level_bpe(["<s>", "<pad>", "</s>", "<unk>", "<mask>"]),
                                  **ROBERTA_SPECIALS)
        model = T.BartForConditionalGeneration(T.BartConfig(
            vocab_size=len(tok), d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_bos_token_id=0,
            forced_eos_token_id=2))
    else:
        raise ValueError(family)
    model.eval().save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def cli(capfd, *args) -> tuple[int, str, str]:
    capfd.readouterr()  # what building the folders printed
    rc = main(list(args))
    out, err = capfd.readouterr()
    return rc, out, err
