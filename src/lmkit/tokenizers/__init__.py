"""Tokenizers: text <-> ids for every lmkit model, in Hugging Face's tokenizer.json format. No torch here.

    tok = lmkit.load_tokenizer(path)                  # tokenizer.json, or a folder holding one
    tok = lmkit.train_tokenizer(texts, kind="bpe", vocab_size=8000, special_tokens=None)
          # kind: "bpe" (byte-level, lossless), "wordpiece" (BERT), "unigram" (SentencePiece), "char", "word"
    ids = tok.encode(text, add_special_tokens=True)   # list[int]; no padding or truncation unless asked
    ids = tok.encode(text, pair=other)                # [CLS] A [SEP] B [SEP] style, per the post-processor
    enc = tok.encode_plus(text, pair=None)            # Encoding: ids, type_ids, attention_mask, special_tokens_mask
    batch = tok.encode_batch(texts)                   # list[list[int]]; tiktoken / both cores when it pays
    batch = tok.encode_batch(texts, padding=True, truncation=True, max_length=128)
    inputs = tok(texts, pair=None, padding=True, truncation=True, max_length=128)
          # {"input_ids", "attention_mask", "token_type_ids"}: lists of lists (a str gives plain lists)
    text = tok.decode(ids, skip_special_tokens=False)
    tok.save(path)                                    # tokenizer.json that `tokenizers` loads
    tok.save_pretrained(folder)                       # + tokenizer_config.json: transformers.AutoTokenizer loads it

    tok.vocab_size (added tokens included), tok.token_to_id(s), tok.id_to_token(i), tok.tokenize(text),
    tok.bos_token_id / eos / pad / unk / mask / cls / sep _token_id (None where the tokenizer has none;
    settable), tok.add_special_tokens([...]).

Pipeline (as in HF): added tokens are cut out first and never split -> normalizer -> pre-tokenizer ->
model (BPE, WordPiece, Unigram, WordLevel) -> post-processor (special tokens, type ids) ; decoding runs
the decoder. Byte-level BPE encodes through tiktoken when the ranks allow it (same ids).

Known difference from HF: character classes come from Python's `unicodedata` (Unicode 14 on 3.11), HF's
from its Rust crates; for a few hundred code points assigned in recent Unicode versions (e.g. U+0898) the
BERT normalizer's accent stripping / control removal / lowercasing can differ.
"""
from lmkit.tokenizers.added_tokens import AddedToken
from lmkit.tokenizers.encoding import Encoding
from lmkit.tokenizers.serialization import load_tokenizer, tokenizer_from_json
from lmkit.tokenizers.tokenizer import Tokenizer
from lmkit.tokenizers.trainers import train_tokenizer

__all__ = ["AddedToken", "Encoding", "Tokenizer", "load_tokenizer", "tokenizer_from_json", "train_tokenizer"]
