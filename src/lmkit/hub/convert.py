"""Weight-name tables between lmkit and Hugging Face, and the code that applies them.

A `Rule` maps one or more lmkit tensors to one Hugging Face tensor: a rename, a transpose
(GPT-2's Conv1D stores weights as (in, out)), a concatenation along dim 0 (GPT-2's fused c_attn), or a split of
the last dimension into heads (XLNet stores each projection as (d_model, n_heads, d_head)).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lmkit.errors import CheckpointError, ConfigError


@dataclass(frozen=True)
class Rule:
    ours: tuple[str, ...]
    hf: str
    transpose: bool = False
    split_heads: int = 0  # > 0: the HF tensor is (rows, split_heads, -1), ours (rows, split_heads * that) (transposed)


def rename(ours: str, hf: str, transpose: bool = False, split_heads: int = 0) -> Rule:
    return Rule((ours,), hf, transpose, split_heads)


def to_hf(state: dict[str, torch.Tensor], rules: list[Rule]) -> dict[str, torch.Tensor]:
    """lmkit state dict -> Hugging Face tensors, by the rules."""
    out = {}
    for rule in rules:
        t = torch.cat([state[name] for name in rule.ours], dim=0) if len(rule.ours) > 1 else state[rule.ours[0]]
        t = t.t() if rule.transpose else t
        out[rule.hf] = (t.reshape(t.shape[0], rule.split_heads, -1) if rule.split_heads else t).contiguous()
    return out


def from_hf(hf: dict[str, torch.Tensor], rules: list[Rule], expected: dict[str, torch.Tensor],
            aliases: tuple[tuple[str, str], ...] = (), source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> lmkit state dict, checking every name and shape against `expected`.

    `aliases` (prefix, replacement) let a base model's names (no "model." / "transformer.") load too.
    """
    out = {}
    for rule in rules:
        candidates = [rule.hf] + [b + rule.hf[len(a):] for a, b in aliases if rule.hf.startswith(a)]
        name = next((c for c in candidates if c in hf), None)
        if name is None and rule.hf == "lm_head.weight":  # a decoder's head, untied by config.json
            raise CheckpointError(f"{source} has no lm_head.weight: it holds a base model saved without its "
                                  "language-model head (e.g. LlamaModel), and config.json does not tie the head to the "
                                  "token embeddings (tie_word_embeddings is false); load a ...ForCausalLM folder")
        if name is None:
            raise CheckpointError(f"{source} lacks tensor {rule.hf!r}: config.json and the weights disagree (more "
                                  "layers than saved, or another family than config.json names); fix config.json "
                                  "or re-save the model")
        t = hf[name]
        if rule.split_heads and t.ndim == 3:
            t = t.reshape(t.shape[0], -1)
        if rule.transpose:
            t = t.t()
        sizes = [expected[o].shape[0] for o in rule.ours]
        if len(rule.ours) > 1 and (t.ndim == 0 or t.shape[0] != sum(sizes)):
            want = (sum(sizes), *expected[rule.ours[0]].shape[1:])
            raise CheckpointError(f"{source}: tensor {rule.hf!r} has shape {tuple(t.shape)} but the config implies "
                                  f"{want}; config.json and the weights disagree (re-save the model)")
        parts = torch.split(t, sizes, dim=0) if len(rule.ours) > 1 else (t,)
        for o, part in zip(rule.ours, parts):
            if tuple(part.shape) != tuple(expected[o].shape):
                raise CheckpointError(f"{source}: tensor {rule.hf!r} has shape {tuple(t.shape)} but the config implies "
                                      f"{tuple(expected[o].shape)} for {o}; config.json and the weights disagree")
            out[o] = part.contiguous()
    return out


def layer_rules(n_layers: int, table: list[tuple], ours_prefix: str, hf_prefix: str) -> list[Rule]:
    """Expand a per-layer table of (ours, hf[, transpose]) templates with {i} over n_layers layers."""
    rules = []
    for i in range(n_layers):
        for entry in table:
            ours, hf = entry[0], entry[1]
            transpose = entry[2] if len(entry) > 2 else False
            ours_names = tuple(ours_prefix.format(i=i) + o.format(i=i) for o in (ours if isinstance(ours, tuple) else (ours,)))
            rules.append(Rule(ours_names, hf_prefix.format(i=i) + hf.format(i=i), transpose))
    return rules


# transformers' ACT2FN names of the functions lmkit has (exact GELU, tanh GELU, ReLU, SiLU), first the name
# lmkit writes for each
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "relu": "relu", "silu": "silu", "swish": "silu",
                  "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_accurate": "gelu_tanh",
                  "gelu_python": "gelu", "gelu_python_tanh": "gelu_tanh", "quick_gelu": "quick_gelu"}
_GLU = {"gelu": "geglu", "gelu_tanh": "geglu_tanh", "relu": "reglu", "silu": "swiglu"}
# the same names gating a GLU FFN (lmkit has no gated quick GELU, so such configs stay refused)
HF_GATED_ACTIVATIONS = {name: _GLU[act] for name, act in HF_ACTIVATIONS.items() if act in _GLU}  # the same names gating a GLU FFN


def hf_activation_name(act: str, table: dict, prefer: tuple[str, ...] = ()) -> str | None:
    """The config.json name of lmkit's activation `act`: the first of `prefer`, then of `table`, that maps to it."""
    return next((name for name in (*prefer, *table) if table.get(name) == act), None)


# transformers classes of encoder-decoder formats that put another head (or none of the decoder) on the stacks
TASK_HEAD_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering", "ForCausalLM",
                      "EncoderModel")


# transformers classes of decoder-only formats with a head CausalLM lacks, and the tensors those heads store
DECODER_HEAD_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
                         "DoubleHeadsModel")
DECODER_HEAD_TENSORS = ("score.weight", "classifier.weight", "qa_outputs.weight", "multiple_choice_head.summary.weight")


def refuse_unloadable(hf: dict, family: str, supported: str, suffixes: tuple[str, ...] = TASK_HEAD_SUFFIXES) -> None:
    """A ConfigError for a config.json whose `architectures` names a class with a head lmkit's model lacks (loading
    it as a language model would silently drop that head, or miss the decoder)."""
    other = [a for a in hf.get("architectures") or () if isinstance(a, str) and a.endswith(suffixes)]
    if other:
        raise ConfigError(f"{other[0]} is a {family} class lmkit does not load (its head or stacks differ from a "
                          f"language model's); lmkit loads {family} folders of {supported} and the bare model")


def hf_activation(hf: dict, key: str, default: str, table: dict, family: str) -> str:
    """The config's activation name under `key`, checked against the names `table` maps to lmkit's."""
    act = hf.get(key, default)
    if act not in table:
        raise ConfigError(f"{family} {key} {act!r} is not supported; use one of {', '.join(table)}")
    return act
