"""Read and write Hugging Face's tokenizer.json (format "1.0"): the pipeline's parts from it and back, a file or
transformers folder read (`TokenizerFile`), written with tokenizer_config.json and special_tokens_map.json. The
`Tokenizer` built from the parts is `tokenizer.py`'s, which imports this module."""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from lmkit.atomic import atomic_write_json
from lmkit.errors import TokenizerError
from lmkit.tokenizers.chat_template import read_chat_templates, write_chat_templates
from lmkit.tokenizers.decoders import decoder_from_json
from lmkit.tokenizers.hf_classes import apply_class_pipeline, padding_side_of
from lmkit.tokenizers.models import model_from_json
from lmkit.tokenizers.normalizers import normalizer_from_json
from lmkit.tokenizers.pre_tokenizers import pre_tokenizer_from_json
from lmkit.tokenizers.processors import BertProcessing, TemplateProcessing, post_processor_from_json
from lmkit.tokenizers.added_tokens import AddedVocabulary

if TYPE_CHECKING:
    from lmkit.tokenizers.tokenizer import Tokenizer


def tokenizer_parts(d: dict) -> tuple:
    """`Tokenizer`'s first arguments from a parsed tokenizer.json: model, normalizer, pre-tokenizer,
    post-processor, decoder, added tokens, truncation, padding."""
    if not isinstance(d, dict) or "model" not in d:
        raise TokenizerError("not a tokenizer.json: it has no \"model\" entry")
    normalizer = normalizer_from_json(d.get("normalizer"))
    model = model_from_json(d["model"])
    added = AddedVocabulary.from_json(d.get("added_tokens") or [], normalizer, model).tokens
    return (model, normalizer, pre_tokenizer_from_json(d.get("pre_tokenizer")),
            post_processor_from_json(d.get("post_processor")), decoder_from_json(d.get("decoder")),
            added, d.get("truncation"), d.get("padding"))


def tokenizer_to_json(tok: Tokenizer) -> dict:
    def dump(x):
        return x.to_json() if x is not None else None
    return {"version": "1.0", "truncation": tok.truncation, "padding": tok.padding,
            "added_tokens": tok.added.to_json(), "normalizer": dump(tok.normalizer),
            "pre_tokenizer": dump(tok.pre_tokenizer), "post_processor": dump(tok.post_processor),
            "decoder": dump(tok.decoder), "model": tok.model.to_json()}


def _read_config(folder: Path) -> dict:
    """tokenizer_config.json of a transformers folder ({} when absent or unreadable)."""
    try:
        d = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def _special_tokens_map(folder: Path) -> dict:
    """Role names from a transformers folder (special_tokens_map.json, else tokenizer_config.json)."""
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        p = folder / name
        if p.is_file():
            try:
                d = json.loads(p.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            roles = {k: v for k, v in d.items() if k.endswith("_token") and isinstance(v, (str, dict))}
            if roles:
                return roles
    return {}


@dataclass
class TokenizerFile:
    """A tokenizer.json as read from a file, or from a folder (then with the folder's settings applied)."""

    path: Path
    data: dict
    special_tokens_map: dict
    config: dict  # the folder's tokenizer_config.json ({} for a file)
    folder: Path | None  # None for a file

    def settle(self, tok: Tokenizer) -> Tokenizer:
        """`tok` built from `data`, given the folder's padding side and chat templates."""
        tok.padding_side = padding_side_of(self.config)
        if self.folder is not None:
            tok.chat_template = read_chat_templates(self.folder)
        return tok


def read_tokenizer_file(path) -> TokenizerFile:
    """tokenizer.json from a file, or from a folder holding one (read as transformers 5 reads the folder:
    `hf_classes`)."""
    p = Path(path)
    if p.is_dir():
        folder, p = p, p / "tokenizer.json"
        if not p.is_file():
            raise TokenizerError(f"{folder} has no tokenizer.json; copy in the tokenizer.json the model was trained "
                                 "with (`lmkit train` writes one; in transformers, tokenizer.save_pretrained does)")
    elif not p.is_file():
        raise TokenizerError(f"no tokenizer at {path}: expected a tokenizer.json file or a folder holding one")
    else:
        folder = p.parent
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise TokenizerError(f"{p} is not valid JSON ({exc}); re-save it with tokenizer.save()") from exc
    if not isinstance(d, dict):
        raise TokenizerError(f"{p} must hold a JSON object (a tokenizer.json), found {type(d).__name__}")
    config = _read_config(folder) if Path(path).is_dir() else {}
    if config:
        d = apply_class_pipeline(d, config)  # a folder reads as transformers 5's AutoTokenizer
    return TokenizerFile(p, d, _special_tokens_map(folder), config, folder if Path(path).is_dir() else None)


@contextmanager
def reading(path: Path) -> Iterator[None]:
    """Errors of building a tokenizer from the file at `path` as one TokenizerError naming the file."""
    try:
        yield
    except TokenizerError as exc:
        raise TokenizerError(f"{path}: {exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        # a field of the wrong JSON type or shape deep in the pipeline description
        raise TokenizerError(f"{path} is malformed ({type(exc).__name__}: {exc}); re-save it with tokenizer.save() "
                             "or restore the original file") from None


def save_pretrained(tok: Tokenizer, folder) -> list[str]:
    """tokenizer.json plus tokenizer_config.json and special_tokens_map.json naming the special tokens, so
    `transformers.AutoTokenizer.from_pretrained(folder)` loads it as a fast tokenizer."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    roles = {}
    for role in ("bos", "eos", "unk", "pad", "mask", "cls", "sep"):
        tid = getattr(tok, f"{role}_token_id")
        if tid is not None:
            roles[f"{role}_token"] = tok.id_to_token(tid)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **roles}
    if isinstance(tok.post_processor, (TemplateProcessing, BertProcessing)) and 1 in tok.post_processor.process([0], [0])[1]:
        # a frame with segment ids: transformers' generic class returns them only when told to (BERT's class does)
        config["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    max_len = (tok.truncation or {}).get("max_length")
    if max_len:
        config["model_max_length"] = max_len
    if tok.padding_side:
        config["padding_side"] = tok.padding_side
    paths = [save_tokenizer(tok, folder / "tokenizer.json")]
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", roles)):
        atomic_write_json(folder / name, obj)
        paths.append(str(folder / name))
    return paths + write_chat_templates(getattr(tok, "chat_template", None), folder)


def save_tokenizer(tok: Tokenizer, path) -> str:
    p = Path(path)
    if p.is_dir() or (not p.suffix and not p.exists()):
        p.mkdir(parents=True, exist_ok=True)
        p = p / "tokenizer.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(p, tokenizer_to_json(tok))
    return str(p)
