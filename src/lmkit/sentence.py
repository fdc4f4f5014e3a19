"""Sentence embeddings from a sentence-transformers folder: encoder, pooling, optional dense layers, normalization.

modules.json lists the modules in order: Transformer (the model folder and sentence_bert_config.json:
max_seq_length, do_lower_case), Pooling (1_Pooling/config.json: cls, max, mean, mean of sqrt length,
concatenated in that order), optional Dense (y = act(W x + b)), optional Normalize (x / ||x||_2).
Mean pooling: e = sum_t m_t h_t / max(sum_t m_t, 1e-9) over the attention mask m.

`encode` tokenizes everything at once, sorts the sentences by token length so each batch holds
similar lengths (little padding), runs the batches under `torch.inference_mode`, and returns float32
rows in the order of the input.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from lmkit.errors import CheckpointError, ConfigError
from lmkit.progress import progress_bar
from lmkit.tokenizers.normalizers import lowercase

MODULE_KINDS = {"Transformer": "transformer", "Pooling": "pooling", "Dense": "dense", "Normalize": "normalize"}
# legacy boolean keys of the pooling config, in the order their vectors are concatenated
LEGACY_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
                  "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                  "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
POOLING_MODES = tuple(LEGACY_POOLING.values())
DENSE_ACTIVATIONS = {"torch.nn.modules.activation.Tanh": torch.tanh, "torch.nn.modules.linear.Identity": lambda x: x,
                     "torch.nn.modules.activation.ReLU": torch.relu, "torch.nn.modules.activation.Sigmoid": torch.sigmoid,
                     "torch.nn.modules.activation.GELU": torch.nn.functional.gelu}


def _read_json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; a sentence-transformers folder needs it") from None
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); restore it from a good copy") from None


def _kind(module: dict) -> str:
    name = str(module.get("type", "")).rsplit(".", 1)[-1]
    if name not in MODULE_KINDS:
        raise ConfigError(f"sentence-transformers module {module.get('type')!r} is not supported by lmkit; "
                          f"supported: {', '.join(MODULE_KINDS)}")
    return MODULE_KINDS[name]


def pool_tokens(h: torch.Tensor, mask: torch.Tensor, modes: tuple[str, ...]) -> torch.Tensor:
    """The pooled vectors of each mode, concatenated: (B, T, d), right-padded mask (B, T) -> (B, d * len(modes)).

    cls: h_0; max: max_t over kept t; mean: sum_t m_t h_t / sum_t m_t; mean_sqrt_len_tokens: the same sum over
    sqrt(sum_t m_t); weightedmean: weights t + 1; lasttoken: the last kept position.
    """
    m = mask.unsqueeze(-1).to(h.dtype)
    parts = []
    for mode in modes:
        if mode == "cls":
            parts.append(h[:, 0])
        elif mode == "max":
            parts.append(h.masked_fill(m == 0, float("-inf")).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            total, count = (h * m).sum(dim=1), m.sum(dim=1).clamp(min=1e-9)
            parts.append(total / count if mode == "mean" else total / count.sqrt())
        elif mode == "weightedmean":
            w = m * torch.arange(1, h.shape[1] + 1, device=h.device, dtype=h.dtype).view(1, -1, 1)
            parts.append((h * w).sum(dim=1) / w.sum(dim=1).clamp(min=1e-9))
        else:  # lasttoken
            last = (mask.sum(dim=1) - 1).clamp(min=0)
            parts.append(h[torch.arange(h.shape[0], device=h.device), last])
    return torch.cat(parts, dim=-1)


@dataclass
class Dense:
    weight: torch.Tensor
    bias: torch.Tensor | None
    act: object

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight.t().to(x.dtype)
        return self.act(y + self.bias.to(x.dtype) if self.bias is not None else y)


class SentenceEncoder:
    """encode(sentences) -> (N, dim) float32 embeddings, the numbers sentence-transformers gives."""

    def __init__(self, model, tokenizer, pooling_modes: tuple[str, ...] = ("mean",),
                 head: list[Dense | str] | None = None, max_seq_length: int = 512, do_lower_case: bool = False,
                 prompts: dict[str, str] | None = None, default_prompt_name: str | None = None,
                 include_prompt: bool = True):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.pooling_modes = tuple(pooling_modes)
        self.max_seq_length, self.do_lower_case = max_seq_length, do_lower_case
        # the modules after pooling, in the order of modules.json: Dense layers and "normalize"
        self.head = list(head or [])
        self.prompts, self.default_prompt_name = dict(prompts or {}), default_prompt_name
        self.include_prompt = include_prompt
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (model.config.pad_token_id or 0)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None) -> "SentenceEncoder":
        """Read a sentence-transformers folder; dtype (e.g. torch.bfloat16) is the model's compute type."""
        from lmkit.hub import load_model
        from lmkit.tokenizers import load_tokenizer

        folder = Path(path)
        if not folder.is_dir():
            raise CheckpointError(f"{folder} is not a folder; pass a sentence-transformers model folder")
        modules = _read_json(folder / "modules.json") if (folder / "modules.json").is_file() else \
            [{"path": "", "type": "sentence_transformers.models.Transformer"},
             {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        model = tokenizer = None
        modes, head, settings, include_prompt = ("mean",), [], {}, True
        for module in sorted(modules, key=lambda m: m.get("idx", 0)):
            kind, sub = _kind(module), folder / module.get("path", "")
            if kind == "transformer":
                transformer_dir = sub
                model = load_model(sub, dtype=dtype)
                if getattr(model, "pooler", None) is not None:
                    model.pooler = None  # sentence-transformers reads the token states, never the pooler
                tokenizer = load_tokenizer(sub)
                for name in ("sentence_bert_config.json", "sentence_xlnet_config.json"):
                    if (sub / name).is_file():
                        settings = _read_json(sub / name)
                        break
            elif kind == "pooling":
                pooling = _read_json(sub / "config.json")
                modes, include_prompt = cls._pooling_modes(pooling), bool(pooling.get("include_prompt", True))
            elif kind == "dense":
                head.append(cls._dense(sub))
            else:
                head.append("normalize")
        if model is None:
            raise ConfigError(f"{folder / 'modules.json'} lists no Transformer module; lmkit needs one")
        # sentence-transformers 2-5 keep max_seq_length in sentence_bert_config.json, 6 in the tokenizer's config
        max_len = settings.get("max_seq_length") or cls._tokenizer_max_length(transformer_dir) or model.config.max_seq_len
        st_config = folder / "config_sentence_transformers.json"
        st_config = _read_json(st_config) if st_config.is_file() else {}
        return cls(model, tokenizer, modes, head, min(int(max_len), model.config.max_seq_len),
                   bool(settings.get("do_lower_case", False)), st_config.get("prompts") or {},
                   st_config.get("default_prompt_name"), include_prompt)

    @staticmethod
    def _pooling_modes(config: dict) -> tuple[str, ...]:
        """The new `pooling_mode` (a name or a list, in order) or the legacy booleans (in their fixed order)."""
        modes = config.get("pooling_mode")
        if modes is None:
            modes = tuple(mode for key, mode in LEGACY_POOLING.items() if config.get(key)) or ("mean",)
        modes = (modes,) if isinstance(modes, str) else tuple(modes)
        bad = [m for m in modes if m not in POOLING_MODES]
        if bad:
            raise ConfigError(f"pooling mode {', '.join(map(str, bad))} is not supported; use {', '.join(POOLING_MODES)}")
        return modes

    @staticmethod
    def _tokenizer_max_length(folder: Path) -> int | None:
        path = folder / "tokenizer_config.json"
        value = _read_json(path).get("model_max_length") if path.is_file() else None
        return int(value) if isinstance(value, (int, float)) and 0 < value < 10**7 else None

    @staticmethod
    def _dense(folder: Path) -> Dense:
        from lmkit.hub.files import read_weights

        cfg = _read_json(folder / "config.json")
        act = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")
        if act not in DENSE_ACTIVATIONS:
            raise ConfigError(f"Dense activation {act!r} is not supported; supported: {', '.join(DENSE_ACTIVATIONS)}")
        weights = read_weights(folder)
        return Dense(weights["linear.weight"].float(), weights.get("linear.bias"), DENSE_ACTIVATIONS[act])

    # encoding ----------------------------------------------------------------------------------------
    def tokenize(self, sentences: list[str]) -> list[list[int]]:
        texts = [s.strip() for s in sentences]
        if self.do_lower_case:  # as the tokenizers Lowercase normalizer (each character alone: no final sigma)
            texts = [lowercase(s) for s in texts]
        return self.tokenizer(texts, truncation=True, max_length=self.max_seq_length)["input_ids"]

    @torch.inference_mode()
    def encode(self, sentences: str | Iterable[str], batch_size: int = 32, normalize_embeddings: bool | None = None,
               show_progress_bar: bool = False, prompt_name: str | None = None, prompt: str | None = None) -> np.ndarray:
        """(N, dim) float32 embeddings (a single string gives (dim,)), in the order of `sentences`.

        normalize_embeddings=True normalizes the output; False leaves the model's own Normalize module in place
        (as sentence-transformers). `prompt` (a string) or `prompt_name` (a key of the folder's prompts) is
        put before every sentence; without either, the folder's default_prompt_name applies."""
        single = isinstance(sentences, str)
        try:
            sentences = [sentences] if single else list(sentences)
        except TypeError:  # None, a number: not a text nor a list of texts
            raise ConfigError(f"encode takes a string or a list of strings, got {type(sentences).__name__}") from None
        if any(not isinstance(s, str) for s in sentences):
            raise ConfigError("encode takes strings; convert other values with str() first")
        text_prompt = self._prompt(prompt_name, prompt)
        if text_prompt:
            sentences = [text_prompt + s for s in sentences]
        if batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
        ids = self.tokenize(sentences)
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        out = None
        starts = range(0, len(order), batch_size)
        # as sentence-transformers: a "Batches" bar when asked (drawn on a terminal only)
        for start in progress_bar(show_progress_bar, iterable=starts, desc="Batches", total=len(starts)):
            rows = [ids[i] for i in order[start:start + batch_size]]
            emb = self._embed(rows, normalize_embeddings)
            if out is None:
                out = np.empty((len(ids), emb.shape[1]), dtype=np.float32)
            out[order[start:start + batch_size]] = emb.numpy()
        if out is None:
            out = np.zeros((0, self.dim), dtype=np.float32)
        return out[0] if single else out

    def _prompt(self, prompt_name: str | None, prompt: str | None) -> str:
        if prompt is None:
            name = prompt_name if prompt_name is not None else self.default_prompt_name
            if name is not None and name not in self.prompts:
                raise ConfigError(f"prompt {name!r} is not one of the model's prompts: {', '.join(self.prompts) or 'none'}")
            prompt = self.prompts[name] if name is not None else ""
        if prompt and not self.include_prompt:
            raise ConfigError("this model's Pooling excludes the prompt tokens (include_prompt false), which lmkit does "
                              "not support; encode without a prompt (prompt='') or use sentence-transformers")
        return prompt

    def _embed(self, rows: list[list[int]], normalize: bool | None) -> torch.Tensor:
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = 1
        device = self.model.device
        h = self.model(input_ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        emb = pool_tokens(h.float(), mask.to(device), self.pooling_modes)
        for layer in self.head:
            emb = torch.nn.functional.normalize(emb, p=2, dim=-1) if isinstance(layer, str) else layer(emb)
        if normalize:
            emb = torch.nn.functional.normalize(emb, p=2, dim=-1)
        return emb.float().cpu()

    @property
    def normalize(self) -> bool:
        """Whether the folder has a Normalize module."""
        return "normalize" in self.head

    @property
    def dim(self) -> int:
        dense = [m for m in self.head if not isinstance(m, str)]
        return dense[-1].weight.shape[0] if dense else self.model.config.d_model * len(self.pooling_modes)


# semantic search ---------------------------------------------------------------------------------------

def paragraphs(documents, min_chars: int = 40) -> tuple[list[str], list[str]]:
    """(passages, ids): the blank-line-separated blocks of at least min_chars characters, whitespace
    collapsed; ids are "document id#n". `documents` holds objects with .id and .text (lmkit Documents)."""
    passages, ids = [], []
    for doc in documents:
        for n, block in enumerate(doc.text.split("\n\n")):
            text = " ".join(block.split())
            if len(text) >= min_chars:
                passages.append(text)
                ids.append(f"{doc.id}#{n}")
    return passages, ids


def top_k(query: np.ndarray, embeddings: np.ndarray, k: int = 5) -> list[tuple[int, float]]:
    """The k rows of embeddings with the largest cosine q.e / (|q| |e|) to query, best first: (row, cosine)."""
    q = query / max(float(np.linalg.norm(query)), 1e-12)
    norms = np.maximum(np.linalg.norm(embeddings, axis=1), 1e-12)
    scores = embeddings @ q / norms
    k = min(k, len(scores))
    best = np.argpartition(-scores, k - 1)[:k] if k else np.array([], dtype=int)
    best = best[np.argsort(-scores[best], kind="stable")]
    return [(int(i), float(scores[i])) for i in best]


class SemanticIndex:
    """Passages and their embeddings; `search(query, k)` ranks passages by cosine to the query's embedding.

    save/load write the embeddings as safetensors and the passages as JSON (atomically)."""

    def __init__(self, encoder: SentenceEncoder, passages: list[str], ids: list[str], embeddings: np.ndarray):
        if not (len(passages) == len(ids) == len(embeddings)):
            raise ValueError("passages, ids and embeddings must have the same length")
        self.encoder, self.passages, self.ids, self.embeddings = encoder, passages, ids, embeddings

    @classmethod
    def build(cls, encoder: SentenceEncoder, passages: list[str], ids: list[str], batch_size: int = 64,
              show_progress_bar: bool = False) -> "SemanticIndex":
        return cls(encoder, passages, ids, encoder.encode(passages, batch_size=batch_size,
                                                          show_progress_bar=show_progress_bar))

    def search(self, query: str, k: int = 5) -> list[tuple[float, str, str]]:
        """(cosine, id, passage) of the k best passages, best first."""
        return [(score, self.ids[i], self.passages[i]) for i, score in top_k(self.encoder.encode(query), self.embeddings, k)]

    def save(self, path) -> None:
        from lmkit.hub.files import atomic_save_safetensors, atomic_write_json

        folder = Path(path)
        atomic_save_safetensors({"embeddings": torch.from_numpy(np.ascontiguousarray(self.embeddings))},
                                folder / "embeddings.safetensors")
        atomic_write_json(folder / "passages.json", {"ids": self.ids, "passages": self.passages})

    @classmethod
    def load(cls, encoder: SentenceEncoder, path) -> "SemanticIndex":
        from lmkit.hub.files import load_safetensors

        folder = Path(path)
        data = _read_json(folder / "passages.json")
        emb = load_safetensors(folder / "embeddings.safetensors")["embeddings"].numpy()
        return cls(encoder, data["passages"], data["ids"], emb)
