"""`Tokenizer.apply_chat_template`, and chat templates read from and written to folders, as transformers 5 does.

Where a folder keeps its templates (the first found wins, per name):
    chat_template.jinja                      the default template
    additional_chat_templates/NAME.jinja     named ones (`tool_use` is picked when tools are passed)
    tokenizer_config.json "chat_template"    legacy: a string, or a list of {"name", "template"}
    chat_template.json {"chat_template"}     legacy processor file
A single `default` template is held as a string, several as {name: template}.

The rendered text is encoded without added special tokens (a template that writes BOS gets one BOS). The
assistant mask marks every token whose character span overlaps a `{% generation %}` span.
"""
from __future__ import annotations

import json
from pathlib import Path

from lmkit.atomic import atomic_write_json, atomic_write_text
from lmkit.tokenizers.chars import CHAR_TO_BYTE
from lmkit.tokenizers.chat_render import GENERATION_TAG, ChatTemplateError, normalize_messages, render_chat
from lmkit.tokenizers.chat_tools import tool_schemas

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
LEGACY_JSON = "chat_template.json"


# ---- files ----------------------------------------------------------------------------------------------------
def read_chat_templates(folder) -> str | dict[str, str] | None:
    """The chat template(s) of a transformers folder, or None when it has none."""
    folder = Path(folder)
    found: dict[str, str] = {}
    config = _json(folder / "tokenizer_config.json")
    legacy = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(legacy, str):
        found["default"] = legacy
    elif isinstance(legacy, list):
        for item in legacy:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str)):
                raise ChatTemplateError(f"{folder / 'tokenizer_config.json'}: chat_template must be a string or a list "
                                        "of {\"name\", \"template\"} objects")
            found[item["name"]] = item["template"]
    if not found:
        processor = _json(folder / LEGACY_JSON)
        if isinstance(processor, dict) and isinstance(processor.get("chat_template"), str):
            found["default"] = processor["chat_template"]
    files: dict[str, str] = {}
    if (folder / TEMPLATE_FILE).is_file():
        files["default"] = _read(folder / TEMPLATE_FILE)
    if (folder / TEMPLATE_DIR).is_dir():
        for p in sorted((folder / TEMPLATE_DIR).glob("*.jinja")):
            files[p.name.removesuffix(".jinja")] = _read(p)
    if files:  # transformers: template files, when present, replace the config's templates altogether
        found = files
    if not found:
        return None
    return found["default"] if list(found) == ["default"] else found


def write_chat_templates(templates: str | dict[str, str] | None, folder) -> list[str]:
    """Write templates as transformers 5's save_pretrained does: default -> chat_template.jinja, the others ->
    additional_chat_templates/NAME.jinja; the legacy keys are removed from tokenizer_config.json."""
    if templates is None:
        return []
    folder = Path(folder)
    named = {"default": templates} if isinstance(templates, str) else dict(templates)
    written = []
    for name, source in named.items():
        if name == "default":
            path = folder / TEMPLATE_FILE
        else:
            if not name or "/" in name or "\\" in name or name.startswith("."):
                raise ChatTemplateError(f"chat template name {name!r} is not a plain file name; rename it")
            (folder / TEMPLATE_DIR).mkdir(parents=True, exist_ok=True)
            path = folder / TEMPLATE_DIR / f"{name}.jinja"
        atomic_write_text(path, source)
        written.append(str(path))
    config_path = folder / "tokenizer_config.json"
    config = _json(config_path)
    if isinstance(config, dict) and "chat_template" in config:
        config.pop("chat_template")
        atomic_write_json(config_path, config)
    return written


def _json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ChatTemplateError(f"{path} is not UTF-8 text; re-save the template as UTF-8") from None


# ---- choosing a template --------------------------------------------------------------------------------------
def choose_template(templates, chat_template: str | None, tools) -> tuple[str, str]:
    """(name, source): the `chat_template` argument (a name or a template), else `tool_use` when tools are given
    and the tokenizer has one, else `default`."""
    if isinstance(templates, dict):
        if chat_template is not None and chat_template in templates:
            return chat_template, templates[chat_template]
        if chat_template is None:
            name = "tool_use" if tools is not None and "tool_use" in templates else "default"
            if name not in templates:
                raise ChatTemplateError(f"this tokenizer's chat templates are {sorted(templates)}, none called "
                                        "'default'; pass chat_template=NAME")
            return name, templates[name]
        return "given", chat_template
    if chat_template is not None:
        return "given", chat_template
    if templates is None:
        raise ChatTemplateError("this tokenizer has no chat template; set tok.chat_template, pass chat_template=..., "
                                "or save one as chat_template.jinja in the folder")
    return "default", templates


# ---- apply_chat_template --------------------------------------------------------------------------------------
def apply_chat_template(tok, conversation, tools=None, documents=None, chat_template: str | None = None,
                        add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                        tokenize: bool = True, padding=False, truncation: bool = False, max_length: int | None = None,
                        return_tensors=None, return_dict: bool = True, return_assistant_tokens_mask: bool = False,
                        tokenizer_kwargs: dict | None = None, sanitize_control_tokens: bool = False, **kwargs):
    """transformers 5's apply_chat_template: the text (tokenize=False), the ids (return_dict=False), else a dict
    with input_ids, attention_mask and, when asked, assistant_masks. A list of conversations gives lists."""
    if return_assistant_tokens_mask and not (return_dict and tokenize):
        raise ChatTemplateError("return_assistant_tokens_mask=True needs return_dict=True and tokenize=True")
    if sanitize_control_tokens:
        raise ChatTemplateError("sanitize_control_tokens is not supported; strip control tokens from user text first")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt do not go together: continue the "
                                "last message, or open a new assistant turn")
    if continue_final_message and return_assistant_tokens_mask:
        raise ChatTemplateError("continue_final_message does not go with return_assistant_tokens_mask")
    name, source = choose_template(getattr(tok, "chat_template", None), chat_template, tools)
    if isinstance(conversation, (list, tuple)) and not conversation:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation; give at least one message")
    batched = isinstance(conversation, (list, tuple)) and (isinstance(conversation[0], (list, tuple))
                                                           or hasattr(conversation[0], "messages"))
    chats = [normalize_messages(c) for c in (conversation if batched else [conversation])]
    tools = tool_schemas(tools)
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise ChatTemplateError("documents are a list of dicts (with 'title' and 'text')")
    variables = {**tok.special_tokens_map, **kwargs}  # keyword arguments win over special tokens of the same name
    mask = return_assistant_tokens_mask
    rendered = [render_chat(source, name, chat, tools=tools, documents=documents,
                            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                            spans=mask, **variables) for chat in chats]
    if mask and not GENERATION_TAG.search(source):
        import warnings
        warnings.warn("return_assistant_tokens_mask=True but the chat template has no {% generation %} block: "
                      "the mask is all zeros", stacklevel=3)
    texts = [text for text, _ in rendered]
    if not tokenize:
        return texts if batched else texts[0]
    if return_tensors is not None and return_tensors != "np":
        hint = (" (lmkit's tokenizers do not import torch): use return_tensors='np' and torch.from_numpy"
                if return_tensors == "pt" else ": use 'np' or None")
        raise ChatTemplateError(f"return_tensors={str(return_tensors)!r} is not supported{hint}")
    extra = dict(tokenizer_kwargs or {})
    multiple, side = extra.pop("pad_to_multiple_of", None), extra.pop("padding_side", None)
    if extra:
        raise ChatTemplateError(f"tokenizer_kwargs {sorted(extra)} are not understood; use padding, truncation, "
                                "max_length, pad_to_multiple_of or padding_side")
    if len(texts) == 1 and padding in (False, True, "longest") and multiple is None:
        # one chat: skip the batch path's thread pool, which costs more than encoding a chat
        encs = [tok._finish(tok._encode_plain(texts[0]), None, False, truncation, max_length)]
    else:
        encs = tok._encodings(texts, None, False, padding, truncation, max_length, multiple, side, None)
    out = {"input_ids": [e.ids for e in encs], "attention_mask": [e.attention_mask for e in encs]}
    if mask:
        out["assistant_masks"] = [_assistant_mask(tok, text, enc, spans, truncation)
                                  for (text, spans), enc in zip(rendered, encs)]
    if not batched:
        out = {k: v[0] for k, v in out.items()}
    if return_tensors == "np":
        out = {k: _as_array(v if batched else [v]) for k, v in out.items()}
    if not return_dict:
        return out["input_ids"]
    return out


def _as_array(rows: list[list[int]]):
    """(B, T) int64 as transformers' BatchEncoding makes it for 'np'; rows of unequal length (no padding) give a (B,)
    object array of int64 rows, as there."""
    import numpy as np

    if len({len(r) for r in rows}) <= 1:
        return np.array(rows, dtype=np.int64).reshape(len(rows), -1)
    out = np.empty(len(rows), dtype=object)
    for i, r in enumerate(rows):
        out[i] = np.array(r, dtype=np.int64)
    return out


def _assistant_mask(tok, text: str, enc, spans: list[tuple[int, int]], truncated: bool = False) -> list[int]:
    """1 for each token overlapping a generation span (a span cut by truncation keeps its remaining tokens)."""
    mask = [0] * len(enc.ids)
    if not spans:
        return mask
    real = [i for i, a in enumerate(enc.attention_mask) if a]
    ids = [enc.ids[i] for i in real]
    offsets = _kept_offsets(tok, text, ids) if truncated else token_offsets(tok, text, ids)
    k = 0
    for j, (start, end) in zip(real, offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[j] = 1
    return mask


def _kept_offsets(tok, text: str, ids: list[int]) -> list[tuple[int, int]]:
    """Offsets of the tokens truncation kept (the start or the end of the whole text's tokens): taken from the whole
    encoding, where a token's span does not depend on where the cut fell."""
    whole = tok._encode_plain(text)
    if len(whole) > len(ids):
        if whole[:len(ids)] == ids:
            return token_offsets(tok, text, whole)[:len(ids)]
        if whole[len(whole) - len(ids):] == ids:
            return token_offsets(tok, text, whole)[len(whole) - len(ids):]
    return token_offsets(tok, text, ids)


# ---- character offsets ----------------------------------------------------------------------------------------
def token_offsets(tok, text: str, ids: list[int]) -> list[tuple[int, int]]:
    """[(start, end)] character span of each token of `text` (ids from the start of its encoding), as `tokenizers`
    reports them: exact for byte-level pipelines, found by re-encoding prefixes for the others."""
    exact = _byte_level_offsets(tok, text, ids)
    return exact if exact is not None else _prefix_offsets(tok, text, ids)


def _trims_offsets(proc) -> bool:
    """Whether the post-processor (or one in its sequence) trims the spaces off byte-level token offsets."""
    if proc is None:
        return False
    if hasattr(proc, "processors"):
        return any(_trims_offsets(p) for p in proc.processors)
    return type(proc).__name__ in ("ByteLevel", "RobertaProcessing") and bool(getattr(proc, "trim_offsets", False))


def _byte_level_offsets(tok, text: str, ids: list[int]) -> list[tuple[int, int]] | None:
    """Offsets from each token's bytes, when the tokens' bytes spell exactly the UTF-8 of `text` (byte-level BPE
    without a normalizer that changed it); None otherwise."""
    raw = text.encode("utf-8")
    char_of = [0] * (len(raw) + 1)
    pos = 0
    for ci, ch in enumerate(text):
        n = len(ch.encode("utf-8"))
        char_of[pos:pos + n] = [ci] * n
        pos += n
    char_of[len(raw)] = len(text)
    trim = _trims_offsets(tok.post_processor)
    out, pos = [], 0
    added = tok.added.id_to_content
    for tid in ids:
        content = added.get(tid)
        token = content if content is not None else tok.id_to_token(tid)
        if token is None:
            return None
        try:
            piece = content.encode("utf-8") if content is not None else bytes(CHAR_TO_BYTE[c] for c in token)
        except KeyError:
            return None
        if raw[pos:pos + len(piece)] != piece:
            return None
        start_b, end_b = pos, pos + len(piece)
        pos = end_b
        start = char_of[start_b]
        end = char_of[end_b - 1] + 1 if end_b > start_b else start
        if trim and content is None:  # tokenizers' trim_offsets: leading/trailing spaces leave the span
            lead = len(piece) - len(piece.lstrip(b" "))
            tail = len(piece) - len(piece.rstrip(b" "))
            if lead:
                start = min(start + lead, end)
            if tail and end >= tail:
                end = max(end - tail, start)
        out.append((start, end))
    return out if pos == len(raw) else None


def _prefix_offsets(tok, text: str, ids: list[int]) -> list[tuple[int, int]]:
    """Offsets where tokens don't map to bytes (SentencePiece-style pipelines, normalizers). Token k ends at the last
    p where the tokens of text[:p] are exactly ids[:k+1]; a token that never closes a prefix (a prepended "▁")
    shares the span of the one that does after it, and each token starts where the last closed one ended."""
    n = len(ids)
    last_end: list[int | None] = [None] * n
    inside = set()  # a prefix cut inside an added token would read its first characters as text
    for content in tok.added.by_content:
        at = text.find(content)
        while at >= 0 and content:
            inside.update(range(at + 1, at + len(content)))
            at = text.find(content, at + 1)
    for p in range(1, len(text) + 1):
        if p in inside:
            continue
        prefix = tok.encode(text[:p], add_special_tokens=False)
        m = len(prefix)
        if 0 < m <= n and prefix == ids[:m]:
            last_end[m - 1] = p
    ends, nxt = [len(text)] * n, len(text)
    for k in range(n - 1, -1, -1):
        nxt = last_end[k] if last_end[k] is not None else nxt
        ends[k] = nxt
    starts, prev = [0] * n, 0
    for k in range(n):
        starts[k] = prev
        if last_end[k] is not None:
            prev = last_end[k]
    return [(min(a, b), b) for a, b in zip(starts, ends)]
