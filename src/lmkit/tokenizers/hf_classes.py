"""The pipelines transformers 5 gives tokenizer classes, whatever a folder's tokenizer.json says.

`AutoTokenizer.from_pretrained(folder)` (transformers 5) builds the class that tokenizer_config.json names. Classes
with their own `__init__` keep the file's vocabulary, merges, added tokens and post-processor but build the
normalizer, pre-tokenizer, decoder and model options themselves: a legacy LLaMA tokenizer.json (Prepend + Replace
normalizer) becomes a Metaspace pre-tokenizer, a T5 file without WhitespaceSplit gains it. `load_tokenizer` on a
folder applies the same rules (a tokenizer.json given as a file is read as the `tokenizers` library reads it).
The classes here are those of the families lmkit loads whose rebuilt pipeline can differ from the converters' files
(MBart50Tokenizer, which also renumbers the vocabulary, is not among them).
"""
from __future__ import annotations

QWEN2_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def _llama(d: dict, config: dict) -> None:
    """LlamaTokenizer: byte-fallback BPE after a Metaspace that prepends ▁ to the first piece only, unless legacy."""
    prefix = config.get("add_prefix_space")
    prefix = True if prefix is None else bool(prefix)
    scheme = ("always" if config.get("legacy", False) else "first") if prefix else "never"
    d["normalizer"] = None
    d["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme, "split": False}
    steps = [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
             {"type": "Fuse"}]
    if prefix:
        steps.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    d["decoder"] = {"type": "Sequence", "decoders": steps}
    d["model"].update(dropout=None, unk_token=None, fuse_unk=True, byte_fallback=True, continuing_subword_prefix=None,
                      end_of_word_suffix=None, ignore_merges=False)


def _precompiled(d: dict) -> dict | None:
    """The file's SentencePiece Precompiled normalizer, which transformers hands to the class; None without one."""
    normalizer = d.get("normalizer") or {}
    parts = normalizer.get("normalizers", [normalizer]) if normalizer.get("type") == "Sequence" else [normalizer]
    return next((n for n in parts if n.get("type") == "Precompiled" and n.get("precompiled_charsmap")), None)


def _unigram(d: dict, unk_id: int, normalizer: dict | None, whitespace_split: bool) -> None:
    """SentencePiece-style Unigram classes: Metaspace (always, split) after WhitespaceSplit or not, a fixed unk id."""
    metaspace = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
    d["normalizer"] = normalizer
    d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}, metaspace]} \
        if whitespace_split else metaspace
    d["decoder"] = dict(metaspace)
    d["model"].update(unk_id=unk_id, byte_fallback=False)


def _t5(d: dict, config: dict) -> None:
    """T5Tokenizer: unk id 2, WhitespaceSplit + Metaspace; of the normalizers only a Precompiled one is kept."""
    _unigram(d, 2, _precompiled(d), True)


def _mbart(d: dict, config: dict) -> None:
    """MBartTokenizer: unk id 3, no normalizer, WhitespaceSplit + Metaspace."""
    _unigram(d, 3, None, True)


def _qwen2(d: dict, config: dict) -> None:
    """Qwen2Tokenizer: NFC, its split regex, then byte-level BPE."""
    d["normalizer"] = {"type": "NFC"}
    d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_REGEX}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": bool(config.get("add_prefix_space") or False),
         "trim_offsets": True, "use_regex": False}]}
    d["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    d["model"].update(dropout=None, unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                      fuse_unk=False, byte_fallback=False)


CLASSES = {"LlamaTokenizer": (_llama, "BPE"), "Qwen2Tokenizer": (_qwen2, "BPE"), "T5Tokenizer": (_t5, "Unigram"),
           "MBartTokenizer": (_mbart, "Unigram")}


# classes whose padding_side is not transformers' "right" default (XLNet puts <cls> last and pads on the left)
CLASS_PADDING_SIDES = {"XLNetTokenizer": "left"}


def padding_side_of(config: dict) -> str | None:
    """The side transformers 5 pads a folder's batches on: tokenizer_config.json's padding_side, else its class's."""
    name = str(config.get("tokenizer_class") or "").removesuffix("Fast")
    return config.get("padding_side") or CLASS_PADDING_SIDES.get(name)


def apply_class_pipeline(d: dict, config: dict) -> dict:
    """tokenizer.json `d` as the class named in tokenizer_config.json (`config`) rebuilds it in transformers 5."""
    name = str(config.get("tokenizer_class") or "").removesuffix("Fast")
    rule = CLASSES.get(name)
    if rule is None or (d.get("model") or {}).get("type") != rule[1]:
        return d
    d = {**d, "model": dict(d["model"])}
    rule[0](d, config)
    return d
