"""The tokenizer pipeline: added tokens -> normalizer -> pre-tokenizer -> model -> post-processor,
and back through the decoder. Encoded words are cached, keyed by the word before any byte mapping."""
from __future__ import annotations

import json
from itertools import chain

from lmkit.errors import TokenizerError
from lmkit.tokenizers.added_tokens import AddedToken, AddedVocabulary
from lmkit.tokenizers.encoding import Encoding, pad, side_of, truncate
from lmkit.tokenizers.fast import encode_many, tiktoken_engine
from lmkit.tokenizers.pre_tokenizers import ByteLevel, byte_level
from lmkit.tokenizers.serialization import (read_tokenizer_file, reading, save_pretrained, save_tokenizer,
                                           tokenizer_parts, tokenizer_to_json)

ROLES = {  # role -> token names that take it, most common first
    "bos": ("<s>", "<|begin_of_text|>", "<|startoftext|>", "[BOS]", "<bos>", "<|endoftext|>"),
    "eos": ("</s>", "<|end_of_text|>", "<|endoftext|>", "[EOS]", "<eos>"),
    "pad": ("[PAD]", "<pad>", "<|pad|>", "<|padding|>"),
    "unk": ("[UNK]", "<unk>", "<|unk|>"),
    "mask": ("[MASK]", "<mask>", "<|mask|>"),
    "cls": ("[CLS]", "<s>", "<cls>"),
    "sep": ("[SEP]", "</s>", "<sep>"),
}
CACHE_LIMIT = 200_000
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _role_property(role: str) -> property:
    def get(self):
        return self._roles.get(role)

    def set_(self, value):
        self._roles[role] = value
    return property(get, set_, doc=f"id of the {role} token, or None; settable")


class Tokenizer:
    """A text <-> ids pipeline read from or written to Hugging Face's tokenizer.json."""

    def __init__(self, model, normalizer=None, pre_tokenizer=None, post_processor=None, decoder=None,
                 added_tokens: list[AddedToken] = (), truncation: dict | None = None, padding: dict | None = None,
                 special_tokens_map: dict[str, str] | None = None):
        self.model, self.normalizer, self.pre_tokenizer = model, normalizer, pre_tokenizer
        self.post_processor, self.decoder = post_processor, decoder
        # tokenizer.json's settings: applied only when asked, then they give what the call leaves open
        self.truncation, self.padding = truncation, padding
        self.padding_side: str | None = None  # a transformers folder's side (tokenizer_config.json's or its class's)
        self.added = AddedVocabulary(list(added_tokens), normalizer)
        self._cache: dict[str, list[int]] = {}
        self._roles: dict[str, int | None] = {}
        self._set_roles(special_tokens_map or {})
        # the role names a folder states (transformers' special_tokens_map, which chat templates see)
        self._named = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in (special_tokens_map or {}).items()
                       if k in SPECIAL_NAMES and (v.get("content") if isinstance(v, dict) else v)}
        self.chat_template: str | dict[str, str] | None = None  # Jinja source, or {name: source}
        self._engine = None
        self._engine_checked = False
        self._size: int | None = None

    # ---- vocabulary -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the size of an embedding table for this tokenizer)."""
        if self._size is None:
            top = max(max(self.model.vocab.values(), default=-1), max(self.added.by_id, default=-1))
            self._size = top + 1
        return self._size

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        v = dict(self.model.vocab)
        v.update({t.content: t.id for t in self.added.tokens})
        return v

    def token_to_id(self, token: str) -> int | None:
        t = self.added.by_content.get(token)
        return t.id if t is not None else self.model.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        t = self.added.id_to_content.get(i)
        return t if t is not None else self.model.id_to_token(i)

    def add_special_tokens(self, tokens: list[str]) -> list[int]:
        """Add tokens that are never split (new ids after the current vocabulary); returns their ids."""
        ids = []
        for content in tokens:
            tid = self.token_to_id(content)
            if tid is None:
                tid = self.vocab_size
            self.added.add(AddedToken(content, tid, special=True))
            self._size = None
            ids.append(tid)
        self._reset()
        self._set_roles({}, keep=True)  # a new token may take an empty role; roles already given stay
        return ids

    def _set_roles(self, mapping: dict[str, str], keep: bool = False) -> None:
        for role, names in ROLES.items():
            if keep and self._roles.get(role) is not None:
                continue
            name = mapping.get(f"{role}_token")
            if isinstance(name, dict):
                name = name.get("content")
            if not name and role == "pad":  # the token tokenizer.json pads with, as transformers reads it
                name = (self.padding or {}).get("pad_token")
            candidates = [name] if name else [n for n in names if n in self.added.by_content]
            if not candidates and role == "unk" and getattr(self.model, "unk_token", None):
                candidates = [self.model.unk_token]
            if not candidates and role == "unk" and getattr(self.model, "unk_id", None) is not None:
                candidates = [self.model.pieces[self.model.unk_id][0]]
            self._roles[role] = next((self.token_to_id(n) for n in candidates if self.token_to_id(n) is not None), None)

    bos_token_id = _role_property("bos")
    eos_token_id = _role_property("eos")
    pad_token_id = _role_property("pad")
    unk_token_id = _role_property("unk")
    mask_token_id = _role_property("mask")
    cls_token_id = _role_property("cls")
    sep_token_id = _role_property("sep")

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """{"bos_token": "<s>", ...}: the roles the folder names (else the roles found), as transformers gives them."""
        if self._named:
            return dict(self._named)
        return {f"{role}_token": self.id_to_token(i) for role, i in self._roles.items()
                if i is not None and f"{role}_token" in SPECIAL_NAMES}

    def apply_chat_template(self, conversation, tools=None, documents=None, chat_template=None,
                            add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                            tokenize: bool = True, padding=False, truncation: bool = False, max_length=None,
                            return_tensors=None, return_dict: bool = True, return_assistant_tokens_mask: bool = False,
                            tokenizer_kwargs=None, **kwargs):
        """Render `conversation` ([{"role", "content"}, ...], or a list of them) with the chat template and encode
        it without added special tokens, as transformers 5 does: text when tokenize=False, ids when
        return_dict=False, else {"input_ids", "attention_mask"[, "assistant_masks"]}. See `chat_template`."""
        from lmkit.tokenizers.chat_template import apply_chat_template
        return apply_chat_template(self, conversation, tools=tools, documents=documents, chat_template=chat_template,
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, tokenize=tokenize, padding=padding,
                                   truncation=truncation, max_length=max_length, return_tensors=return_tensors,
                                   return_dict=return_dict, return_assistant_tokens_mask=return_assistant_tokens_mask,
                                   tokenizer_kwargs=tokenizer_kwargs, **kwargs)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self.added.special_ids)

    def set_normalizer(self, normalizer) -> None:
        """Replace the normalizer, as assigning `tokenizers.Tokenizer.normalizer`: added tokens with
        normalized=True are matched in the new normalized form from then on."""
        self.normalizer = self.added.normalizer = normalizer
        self.added._rebuild()
        self._reset()

    # ---- encoding ---------------------------------------------------------------------------
    def _reset(self) -> None:
        self._cache.clear()
        self._engine, self._engine_checked, self._size = None, False, None

    def _words(self, text: str, first: bool) -> list[int]:
        """Ids of one normalized stretch without added tokens: pre-tokenize, then the cached model."""
        cache, pre = self._cache, self.pre_tokenizer
        if len(cache) > CACHE_LIMIT:
            cache.clear()
        if type(pre) is ByteLevel:  # cache keys are the words before the byte mapping
            words, mapped = pre.raw_split(text), byte_level
        else:
            words, mapped = (pre.split(text, first) if pre is not None else ([text] if text else [])), None
        try:
            return list(chain.from_iterable(map(cache.__getitem__, words)))
        except KeyError:
            tokenize = self.model.tokenize_ids
            for w in words:
                if w not in cache:
                    cache[w] = tokenize(mapped(w) if mapped else w)
        return list(chain.from_iterable(map(cache.__getitem__, words)))

    def _encode_plain(self, text: str, python_only: bool = False) -> list[int]:
        """Ids of `text` with no post-processing: tiktoken when it applies, else the Python pipeline."""
        if not python_only:
            engine = self.engine()
            if engine is not None:
                return engine.encode(text)
        ids: list[int] = []
        for piece, tid, first in self._stretches(text):
            if tid is not None:
                ids.append(tid)
            else:
                ids += self._words(piece, first)
        return ids

    def _stretches(self, text: str) -> list[tuple[str, int | None, bool]]:
        """[(piece, added-token id or None, starts at the text's start)]; pieces with None are normalized."""
        if self.added.tokens:
            return self.added.split(text)
        if self.normalizer is None:
            return [(text, None, True)]
        piece, kept = self.normalizer.normalize_start(text)
        return [(piece, None, kept)]

    def engine(self):
        """The tiktoken engine for this byte-level BPE, or None when tiktoken is absent or cannot match it."""
        if not self._engine_checked:
            self._engine, self._engine_checked = tiktoken_engine(self), True
        return self._engine

    def _finish(self, a: list[int], b: list[int] | None, add_special_tokens: bool, truncation: bool,
                max_length: int | None) -> Encoding:
        proc = self.post_processor
        if truncation:
            json = self.truncation or {}
            max_length = max_length or json.get("max_length")
            if not max_length:
                raise TokenizerError("truncation=True needs max_length=N")
            a, b = truncate(a, b, max_length, proc.added_tokens(b is not None) if proc and add_special_tokens else 0,
                            json.get("strategy", "longest_first"), side_of(json.get("direction")))
        if proc is not None:  # also without special tokens: a template still orders A and B and sets type ids
            ids, types, special = proc.process(a, b, add_special_tokens)
        else:
            ids = a + (b or [])
            types, special = [0] * len(a) + [1] * len(b or []), [0] * len(ids)
        return Encoding(ids, types, [1] * len(ids), special)

    def encode(self, text: str, pair: str | None = None, add_special_tokens: bool = True, truncation: bool = False,
               max_length: int | None = None) -> list[int]:
        """Ids of `text` (and of `pair` after it, when given). No truncation unless asked."""
        if pair is None and not truncation:
            ids = self._encode_plain(text)
            return self.post_processor.process(ids, None)[0] if add_special_tokens and self.post_processor else ids
        return self.encode_plus(text, pair, add_special_tokens, truncation, max_length).ids

    def encode_plus(self, text: str, pair: str | None = None, add_special_tokens: bool = True,
                    truncation: bool = False, max_length: int | None = None) -> Encoding:
        """An `Encoding` with ids, type_ids (0 for text, 1 for pair), attention_mask and special_tokens_mask."""
        _check_text(text)
        a = self._encode_plain(text)
        b = self._encode_plain(_check_text(pair)) if pair is not None else None
        return self._finish(a, b, add_special_tokens, truncation, max_length)

    def encode_pair(self, text: str, pair: str, **kw) -> Encoding:
        return self.encode_plus(text, pair, **kw)

    def _encodings(self, texts, pairs, add_special_tokens, padding, truncation, max_length, pad_to_multiple_of,
                   padding_side, num_workers) -> list[Encoding]:
        """Truncated and padded encodings of a batch. What the call leaves open (max_length, truncation strategy
        and side, padding side, multiple, pad token and type id) comes from tokenizer.json's settings."""
        plain = encode_many(self, texts, num_workers)
        bs = encode_many(self, [_check_text(p) for p in pairs], num_workers) if pairs is not None else [None] * len(texts)
        if pairs is not None and len(bs) != len(texts):
            raise TokenizerError(f"{len(texts)} texts but {len(bs)} pairs; give one pair per text")
        encs = [self._finish(a, b, add_special_tokens, truncation, max_length) for a, b in zip(plain, bs)]
        if padding:
            if padding not in (True, "longest", "max_length"):
                raise TokenizerError(f"padding must be False, True, 'longest' or 'max_length', not {padding!r}")
            json = self.padding or {}
            length = None
            if padding == "max_length":
                fixed = json.get("strategy") if isinstance(json.get("strategy"), dict) else {}
                length = max_length or fixed.get("Fixed") or (self.truncation or {}).get("max_length")
                if not length:
                    raise TokenizerError("padding='max_length' needs max_length=N")
            multiple = pad_to_multiple_of if pad_to_multiple_of is not None else json.get("pad_to_multiple_of")
            side = side_of(padding_side or self.padding_side or json.get("direction"))
            pad(encs, self.pad_token_id, length, multiple, side, json.get("pad_type_id", 0))
        return encs

    def encode_batch(self, texts, pairs=None, add_special_tokens: bool = True, padding=False,
                     truncation: bool = False, max_length: int | None = None, num_workers: int | None = None,
                     pad_to_multiple_of: int | None = None, padding_side: str | None = None):
        """Ids of each text. Fast paths: tiktoken's threads, or for the Python pipeline and large batches,
        a pool of `num_workers` processes (default: the CPU count). Pads only when asked."""
        texts = _check_batch(texts, pairs)
        if pairs is None and not truncation and not padding:
            plain = encode_many(self, texts, num_workers)
            if add_special_tokens and self.post_processor is not None:
                return [self.post_processor.process(ids, None)[0] for ids in plain]
            return plain
        return [e.ids for e in self._encodings(texts, pairs, add_special_tokens, padding, truncation, max_length,
                                               pad_to_multiple_of, padding_side, num_workers)]

    def __call__(self, text, pair=None, add_special_tokens: bool = True, padding=False, truncation: bool = False,
                 max_length: int | None = None, pad_to_multiple_of: int | None = None, padding_side: str | None = None):
        """Model inputs for a string or a list of strings: {"input_ids", "attention_mask", "token_type_ids"}
        as lists (a batch: lists of lists). padding: False, True/"longest" or "max_length"; padding_side
        "right" unless given or set in tokenizer.json."""
        single = isinstance(text, str)
        texts = [text] if single else _check_batch(text, pair)
        pairs = None if pair is None else ([pair] if single else list(pair))
        encs = self._encodings(texts, pairs, add_special_tokens, padding, truncation, max_length, pad_to_multiple_of,
                               padding_side, None)
        out = {"input_ids": [e.ids for e in encs], "attention_mask": [e.attention_mask for e in encs],
               "token_type_ids": [e.type_ids for e in encs]}
        return {k: v[0] for k, v in out.items()} if single else out

    def tokenize(self, text: str) -> list[str]:
        """Token strings of `text` without special tokens (to see how a text splits): HF's `Encoding.tokens`, where
        an unknown stretch of a Unigram model shows as its text, an added token as the text it matched."""
        out: list[str] = []
        pre, model = self.pre_tokenizer, self.model
        for piece, tid, first in self._stretches(text):
            if tid is not None:  # the matched text, with what lstrip/rstrip swallowed, as HF shows it
                out.append(piece)
                continue
            for w in (pre.split(piece, first) if pre is not None else ([piece] if piece else [])):
                out += model.tokenize(w)
        return out

    # ---- decoding ---------------------------------------------------------------------------
    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; special tokens are kept unless skip_special_tokens. Ids past the vocabulary are
        skipped, as `tokenizers` does (a model's embedding table is often padded past it: T5 has 32128 rows
        for 32100 tokens)."""
        tokens = []
        special = self.added.special_contents if skip_special_tokens else ()
        for i in ids:
            i = int(i)
            if i < 0:
                raise TokenizerError(f"cannot decode the negative id {i}; token ids are >= 0 (drop padding such as -100 first)")
            t = self.id_to_token(i)
            if t is not None and t not in special:
                tokens.append(t)
        return self.decoder.decode(tokens) if self.decoder is not None else " ".join(tokens)

    def decode_batch(self, batch, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    # ---- files ------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return tokenizer_to_json(self)

    @classmethod
    def from_file(cls, path) -> Tokenizer:
        """Same as `load_tokenizer(path)`."""
        return load_tokenizer(path)

    @classmethod
    def from_str(cls, text: str) -> Tokenizer:
        """A tokenizer from the text of a tokenizer.json."""
        return tokenizer_from_json(json.loads(text))

    def to_str(self) -> str:
        return json.dumps(self.to_json(), ensure_ascii=False)

    def save(self, path) -> str:
        """Write tokenizer.json (a folder gets path/tokenizer.json) atomically; returns the file written."""
        return save_tokenizer(self, path)

    def save_pretrained(self, folder) -> list[str]:
        """A folder `transformers.AutoTokenizer` loads: tokenizer.json, tokenizer_config.json, special_tokens_map.json."""
        return save_pretrained(self, folder)

    def __getstate__(self):
        return {"json": self.to_str(), "roles": self._roles, "padding_side": self.padding_side, "named": self._named,
                "chat_template": self.chat_template}

    def __setstate__(self, state):
        other = tokenizer_from_json(json.loads(state["json"]))
        self.__dict__.update(other.__dict__)
        self._roles = state["roles"]
        self.padding_side = state.get("padding_side")
        self._named, self.chat_template = state.get("named", {}), state.get("chat_template")

    def __repr__(self) -> str:
        return f"Tokenizer({type(self.model).__name__}, vocab_size={self.vocab_size})"


def _check_batch(texts, pairs) -> list[str]:
    """A batch must be a list of texts (a str would be taken character by character), pairs a list as well."""
    for what, x in (("texts", texts), ("pairs", pairs)):
        if isinstance(x, str):
            raise TokenizerError(f"a batch takes a list of {what}, not one string; wrap it in a list (or use encode)")
    return [_check_text(t) for t in texts]


def _check_text(text):
    if not isinstance(text, str):
        raise TokenizerError(f"tokenizers encode str, not {type(text).__name__}; decode bytes to text first")
    return text


def tokenizer_from_json(d: dict, special_tokens_map: dict | None = None) -> Tokenizer:
    """A `Tokenizer` from a parsed tokenizer.json."""
    return Tokenizer(*tokenizer_parts(d), special_tokens_map)


def load_tokenizer(path) -> Tokenizer:
    """A `Tokenizer` from a tokenizer.json file, or from a folder holding one (read as transformers 5 reads the
    folder: `hf_classes`)."""
    found = read_tokenizer_file(path)
    with reading(found.path):
        return found.settle(tokenizer_from_json(found.data, found.special_tokens_map))
