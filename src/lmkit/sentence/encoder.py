"""Sentence embeddings from a sentence-transformers folder: encoder, pooling, optional dense layers, normalization.

modules.json lists the modules in order: Transformer (the model folder and sentence_bert_config.json:
max_seq_length, do_lower_case), Pooling (1_Pooling/config.json: cls, max, mean, mean of sqrt length,
weighted mean, last token, concatenated in the order given), then Dense (y = act(W x + b)), LayerNorm,
Dropout (the identity) and Normalize (x / ||x||_2) in their order.
Mean pooling: e = sum_t m_t h_t / max(sum_t m_t, 1e-9) over the attention mask m.

`encode` tokenizes everything at once, sorts the sentences by token length and cuts batches where the lengths
spread (`length_batches`: little padding; a left-padding tokenizer gets sentence-transformers' batches instead), runs the
batches under `torch.inference_mode`, and returns float32 rows in the order of the input.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from lmkit.device import place
from lmkit.errors import CheckpointError, ConfigError
from lmkit.hub import load_model
from lmkit.hub.files import read_json, read_weights
from lmkit.progress import progress_bar
from lmkit.sentence.pooling import QUANTIZE, Dense, dense_activation, pool_tokens, quantize
from lmkit.tokenizers import load_tokenizer
from lmkit.tokenizers.encoding import side_of
from lmkit.tokenizers.normalizers import Lowercase, Sequence

MODULE_KINDS = {"Transformer": "transformer", "Pooling": "pooling", "Dense": "dense", "Normalize": "normalize",
                "LayerNorm": "layernorm", "Dropout": "dropout"}
# the Transformer module's settings file, by the names sentence-transformers has written it under
SETTINGS_FILES = tuple(f"sentence_{name}_config.json"
                       for name in ("bert", "roberta", "distilbert", "camembert", "albert", "xlm-roberta", "xlnet"))
# legacy boolean keys of the pooling config, in the order their vectors are concatenated
LEGACY_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
                  "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                  "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
POOLING_MODES = tuple(LEGACY_POOLING.values())



def _causal_lm(folder: Path) -> bool:
    """Whether config.json names a ...ForCausalLM architecture that is causal (sentence-transformers' test)."""
    config = _read_json(folder / "config.json")
    arch = config.get("architectures") or [""]
    return str(arch[0]).endswith("ForCausalLM") and config.get("is_causal", True) is not False


def _read_json(path: Path) -> dict | list:
    return read_json(path, "a sentence-transformers folder needs it", (dict, list))


def _tokenizer_config(folder: Path) -> dict:
    path = folder / "tokenizer_config.json"
    config = _read_json(path) if path.is_file() else {}
    return config if isinstance(config, dict) else {}


def _max_length(tokenizer_config: dict) -> int | None:
    value = tokenizer_config.get("model_max_length")
    return int(value) if isinstance(value, (int, float)) and 0 < value < 10**7 else None


def _lowercase_first(tokenizer) -> None:
    """do_lower_case as sentence-transformers 6 applies it: a Lowercase normalizer before the tokenizer's own,
    unless one is there already, so special tokens are still matched on the text as written."""
    norm = tokenizer.normalizer
    inner = norm.normalizers if isinstance(norm, Sequence) else [norm] if norm is not None else []
    if not any(isinstance(n, Lowercase) for n in inner):
        tokenizer.set_normalizer(Sequence([Lowercase(), *inner]))


def _kind(module: dict) -> str:
    name = str(module.get("type", "")).rsplit(".", 1)[-1]
    if name not in MODULE_KINDS:
        raise ConfigError(f"sentence-transformers module {module.get('type')!r} is not supported by lmkit; "
                          f"supported: {', '.join(MODULE_KINDS)}")
    return MODULE_KINDS[name]


def length_batches(order: list[int], lengths: list[int], batch_size: int, spread: float = 0.9,
                   min_tokens: int = 1024) -> list[list[int]]:
    """`order` (rows sorted longest first, `lengths` their token counts) cut into batches of at most batch_size
    rows. A batch also ends before a row shorter than `spread` times its longest once it holds min_tokens padded
    tokens: texts of mixed lengths then pad by at most ~10% (fixed batches of 64 passages pad ~17%), while short
    texts, whose batches never reach min_tokens early, keep full batches."""
    batches, start = [], 0
    while start < len(order):
        width, end = lengths[start], start + 1
        while end < len(order) and end - start < batch_size and \
                (lengths[end] >= spread * width or (end - start) * width < min_tokens):
            end += 1
        batches.append(order[start:end])
        start = end
    return batches


class SentenceEncoder:
    """encode(sentences) -> (N, dim) float32 embeddings, the numbers sentence-transformers gives."""

    def __init__(self, model, tokenizer, pooling_modes: tuple[str, ...] = ("mean",),
                 head: list[Dense | str] | None = None, max_seq_length: int = 512, do_lower_case: bool = False,
                 prompts: dict[str, str] | None = None, default_prompt_name: str | None = None,
                 include_prompt: bool = True, padding_side: str = "right", truncation_side: str = "right",
                 device: str | torch.device | None = None):
        # device (sentence-transformers' argument): where the model runs; None leaves it where it is
        self.model, self.tokenizer = place(model, device).eval(), tokenizer
        self.pooling_modes = tuple(pooling_modes)
        self.max_seq_length, self.do_lower_case = max_seq_length, do_lower_case
        if do_lower_case:
            _lowercase_first(tokenizer)
        # the modules after pooling, in the order of modules.json: Dense and LayerNorm layers, "normalize"
        self.head = list(head or [])
        self.prompts, self.default_prompt_name = dict(prompts or {}), default_prompt_name
        if default_prompt_name is not None and default_prompt_name not in self.prompts:
            raise ConfigError(f"default_prompt_name {default_prompt_name!r} is not one of the prompts "
                              f"({', '.join(self.prompts) or 'none'}); fix config_sentence_transformers.json")
        self.include_prompt = include_prompt
        # the tokenizer config's sides, which transformers applies over tokenizer.json's own
        self.padding_side, side = side_of(padding_side), side_of(truncation_side)
        if side != side_of((tokenizer.truncation or {}).get("direction")):  # kept a valid tokenizer.json setting
            base = tokenizer.truncation or {"max_length": max_seq_length, "strategy": "LongestFirst", "stride": 0}
            tokenizer.truncation = {**base, "direction": side.capitalize()}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (model.config.pad_token_id or 0)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None,
                        device: str | torch.device | None = None) -> "SentenceEncoder":
        """Read a sentence-transformers folder; dtype (e.g. torch.bfloat16) is the model's compute type, device
        ("auto", "cpu", "cuda[:N]", "mps"; None: the CPU) where it runs. Embeddings come back on the CPU (numpy)."""
        folder = Path(path)
        if not folder.is_dir():
            raise CheckpointError(f"{folder} is not a folder; pass a sentence-transformers model folder")
        # a plain Hugging Face folder: the encoder and mean pooling, as sentence-transformers builds it
        modules = _read_json(folder / "modules.json") if (folder / "modules.json").is_file() else \
            [{"path": "", "type": "sentence_transformers.models.Transformer"}]
        model = tokenizer = None
        modes, head, settings, include_prompt = ("mean",), [], {}, True
        for module in sorted(modules, key=lambda m: m.get("idx", 0)):
            kind, sub = _kind(module), folder / module.get("path", "")
            if kind == "transformer":
                transformer_dir = sub
                model = load_model(sub, dtype=dtype, device=device)
                if model.config.architecture == "encoder-decoder" and model.config.family not in ("t5", "mt5"):
                    # sentence-transformers embeds T5 by its encoder alone, but BART by its decoder's states
                    raise ConfigError(f"{sub} holds a {model.config.family} encoder-decoder model; lmkit embeds "
                                      "sentences with encoders (BERT, RoBERTa, DistilBERT), the encoder of T5/mT5, "
                                      "or decoders: use one of those")
                if getattr(model, "pooler", None) is not None:
                    model.pooler = None  # sentence-transformers reads the token states, never the pooler
                tokenizer = load_tokenizer(sub)
                for name in SETTINGS_FILES:
                    if (sub / name).is_file():
                        settings = _read_json(sub / name)
                        break
            elif kind == "pooling":
                pooling = _read_json(sub / "config.json")
                modes, include_prompt = cls._pooling_modes(pooling), bool(pooling.get("include_prompt", True))
            elif kind == "dense":
                head.append(cls._dense(sub))
            elif kind == "layernorm":
                head.append(cls._layer_norm(sub))
            elif kind == "dropout":
                continue  # the identity at inference
            else:
                head.append("normalize")
        if model is None:
            raise ConfigError(f"{folder / 'modules.json'} lists no Transformer module; lmkit needs one")
        if not (folder / "modules.json").is_file() and _causal_lm(folder):
            modes = ("lasttoken",)  # sentence-transformers pools a plain ...ForCausalLM folder by its last token
        # sentence-transformers 2-5 keep max_seq_length in sentence_bert_config.json, 6 in the tokenizer's config
        # the tokenizer arguments' model_max_length wins over max_seq_length, as sentence-transformers passes them
        tokenizer_args = settings.get("processor_kwargs") or settings.get("tokenizer_args") or {}
        tokenizer_config = _tokenizer_config(transformer_dir)
        max_len = tokenizer_args.get("model_max_length") or settings.get("max_seq_length") or \
            _max_length(tokenizer_config) or model.config.max_seq_len
        sides = [tokenizer_args.get(key, tokenizer_config.get(key)) or "right" for key in ("padding_side", "truncation_side")]
        st_config = folder / "config_sentence_transformers.json"
        st_config = _read_json(st_config) if st_config.is_file() else {}
        return cls(model, tokenizer, modes, head, min(int(max_len), model.config.max_seq_len),
                   bool(settings.get("do_lower_case", False)), st_config.get("prompts") or {},
                   st_config.get("default_prompt_name"), include_prompt, *sides)

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
    def _dense(folder: Path) -> Dense:
        cfg = _read_json(folder / "config.json")
        if cfg.get("module_input_name", "sentence_embedding") != "sentence_embedding" or \
                cfg.get("module_output_name", "sentence_embedding") != "sentence_embedding":
            raise ConfigError(f"{folder}: a Dense layer on other features than the sentence embedding is not "
                              "supported by lmkit; use sentence-transformers for this model")
        act = dense_activation(cfg.get("activation_function", "torch.nn.modules.activation.Tanh"))
        weights = read_weights(folder)
        residual = bool(cfg.get("use_residual", False))
        if residual and "residual.weight" in weights:
            residual = weights["residual.weight"].float()
        return Dense(weights["linear.weight"].float(), weights.get("linear.bias"), act.eval(), residual)

    @staticmethod
    def _layer_norm(folder: Path):
        """LayerNorm of the sentence embedding: (x - mean) / sqrt(var + 1e-5) * w + b (torch.nn.LayerNorm)."""
        weights = read_weights(folder)
        w, b = weights["norm.weight"].float(), weights["norm.bias"].float()
        return lambda x: torch.nn.functional.layer_norm(x, w.shape, w.to(x), b.to(x), 1e-5)

    # encoding ----------------------------------------------------------------------------------------
    def tokenize(self, sentences: list[str]) -> list[list[int]]:
        """Ids of each text as given (sentence-transformers 6 does not strip), cut at max_seq_length."""
        return self.tokenizer(list(sentences), truncation=True, max_length=self.max_seq_length)["input_ids"]

    @torch.inference_mode()
    def encode(self, sentences: str | Iterable[str], batch_size: int = 32, normalize_embeddings: bool | None = None,
               show_progress_bar: bool = False, prompt_name: str | None = None, prompt: str | None = None,
               output_value: str = "sentence_embedding", precision: str = "float32", convert_to_numpy: bool = True,
               convert_to_tensor: bool = False, truncate_dim: int | None = None):
        """(N, dim) float32 embeddings (a single string gives (dim,)), in the order of `sentences`.

        The options mean what they mean in sentence-transformers' `encode`: normalize_embeddings=True normalizes
        the output (False leaves the model's own Normalize module in place); `prompt`, or `prompt_name` (a key of
        the folder's prompts; default: its default_prompt_name), is put before every sentence; truncate_dim keeps
        the first dimensions (before normalize_embeddings); precision "int8"/"uint8" (bucket ranges from these
        embeddings), "binary"/"ubinary" (sign bits, packed); convert_to_tensor gives a torch tensor,
        convert_to_numpy=False a list of 1-D tensors; output_value="token_embeddings" gives each input's token
        states, a (T_i, d) tensor of its own tokens (padding left out on either side, as in sentence-transformers
        6.3). An empty list gives a (0, dim) float32 array, as DESIGN's (N, dim) contract says (sentence-transformers:
        np.array([]), shape (0,) float64)."""
        single = isinstance(sentences, str)
        try:
            sentences = [sentences] if single else list(sentences)
        except TypeError:  # None, a number: not a text nor a list of texts
            raise ConfigError(f"encode takes a string or a list of strings, got {type(sentences).__name__}") from None
        if any(not isinstance(s, str) for s in sentences):
            raise ConfigError("encode takes strings; convert other values with str() first")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
        tokens = output_value == "token_embeddings"
        if output_value != "sentence_embedding" and not tokens:
            raise ConfigError(f"output_value {output_value!r} is not supported; use 'sentence_embedding' or "
                              "'token_embeddings'")
        if precision not in QUANTIZE:
            raise ConfigError(f"precision {precision!r} is not supported; use one of {', '.join(QUANTIZE)}")
        if tokens and precision != "float32":
            raise ConfigError("precision applies to sentence embeddings; quantize token embeddings yourself")
        text_prompt, texts = self._prompt(prompt_name, prompt), sentences
        if text_prompt:
            sentences = [text_prompt + s for s in sentences]
        ids = self.tokenize(sentences)
        skip = self._prompt_length(text_prompt) if text_prompt and not self.include_prompt else 0
        # longest first, in tokens: the least padding. With left padding and absolute positions a row's numbers
        # depend on the padding its batch gives it, so there the batches are sentence-transformers' (by characters)
        if self.padding_side == "left":
            order = np.argsort([-len(s) for s in texts]).tolist()
            batches = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
        else:
            order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
            batches = length_batches(order, [len(ids[i]) for i in order], batch_size)
        out: list = [None] * len(ids)
        # as sentence-transformers: a "Batches" bar when asked (drawn on a terminal only)
        for chunk in progress_bar(show_progress_bar, iterable=batches, desc="Batches", total=len(batches)):
            rows = self._embed([ids[i] for i in chunk], normalize_embeddings, skip, truncate_dim, tokens)
            for i, row in zip(chunk, rows):
                out[i] = row
        if tokens:
            return out[0] if single else out
        dim = self.dim if truncate_dim is None else min(truncate_dim, self.dim)
        emb = torch.stack(out) if out else torch.zeros((0, dim), device=self.model.device)
        if precision != "float32" and len(out):
            emb = torch.from_numpy(quantize(emb.cpu().numpy(), precision))
        if convert_to_tensor:
            result = emb
        elif convert_to_numpy:
            result = emb.cpu().numpy()
        else:
            result = list(emb)
        return result[0] if single else result

    def _prompt(self, prompt_name: str | None, prompt: str | None) -> str:
        if prompt is None:
            name = prompt_name if prompt_name is not None else self.default_prompt_name
            if name is not None and name not in self.prompts:
                raise ConfigError(f"prompt {name!r} is not one of the model's prompts: {', '.join(self.prompts) or 'none'}")
            prompt = self.prompts[name] if name is not None else ""
        return prompt

    def _prompt_length(self, prompt: str) -> int:
        """Tokens of the prompt left out of pooling (include_prompt false), as sentence-transformers counts them:
        the prompt tokenized alone, less a closing special token ([SEP], </s>)."""
        ids = self.tokenize([prompt])[0]
        return len(ids) - (1 if ids and ids[-1] in self.tokenizer.all_special_ids else 0)

    def _embed(self, rows: list[list[int]], normalize: bool | None, skip: int = 0, truncate_dim: int | None = None,
               tokens: bool = False) -> list[torch.Tensor]:
        """Each row's float32 sentence embedding, or with tokens=True its token states (T_i, d)."""
        width, device = max(len(r) for r in rows), self.model.device
        lengths = torch.tensor([len(r) for r in rows])
        start = width - lengths if self.padding_side == "left" else torch.zeros_like(lengths)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, int(start[i]):int(start[i]) + len(r)] = torch.tensor(r)
        t = torch.arange(width).view(1, -1)
        mask = ((t >= start.view(-1, 1)) & (t < (start + lengths).view(-1, 1))).long()
        if self.model.config.architecture == "encoder-decoder":  # T5: its encoder, as sentence-transformers loads it
            h = self.model.encode(input_ids.to(device), attention_mask=mask.to(device)).float()
        else:
            h = self.model(input_ids.to(device), attention_mask=mask.to(device)).last_hidden_state.float()
        if tokens:  # the row's own tokens, padding cut on either side (sentence-transformers 6.3)
            return [h[i, int(start[i]):int(start[i]) + len(r)] for i, r in enumerate(rows)]
        # the prompt's tokens attend and are attended to, but are not pooled
        pooled = mask * (t >= (start + skip).view(-1, 1))
        emb = pool_tokens(h, pooled.to(device), self.pooling_modes, start.to(device))
        for layer in self.head:
            emb = torch.nn.functional.normalize(emb, p=2, dim=-1) if isinstance(layer, str) else layer(emb)
        if truncate_dim is not None:
            emb = emb[:, :truncate_dim]
        if normalize:
            emb = torch.nn.functional.normalize(emb, p=2, dim=-1)
        return list(emb.float())

    @property
    def normalize(self) -> bool:
        """Whether the folder has a Normalize module."""
        return "normalize" in self.head

    @property
    def dim(self) -> int:
        dense = [m for m in self.head if isinstance(m, Dense)]
        return dense[-1].weight.shape[0] if dense else self.model.config.d_model * len(self.pooling_modes)

