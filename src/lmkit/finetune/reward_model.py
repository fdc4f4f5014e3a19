"""A reward model as GRPO's reward: a transformers ...ForSequenceClassification folder with num_labels=1 (a causal
LM body and a linear `score` head), read as TRL reads it: r = score(h_last), h_last the final hidden state of the
last token of prompt + completion (tokenized without special tokens, as TRL's GRPOTrainer does).

The body loads through lmkit's hub as the family's language model (the head's tensor set apart, a placeholder LM
head where the folder has none: only the hidden states are read).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from lmkit.errors import ConfigError
from lmkit.hub import load_model
from lmkit.hub.files import read_weights, write_weights
from lmkit.tokenizers import load_tokenizer


class RewardModel:
    """score(prompt + completion) of a ...ForSequenceClassification folder with one label."""

    def __init__(self, folder: str, device=None):
        path = Path(folder)
        raw = json.loads((path / "config.json").read_text(encoding="utf-8")) if (path / "config.json").is_file() else {}
        kind = next((a for a in raw.get("architectures") or () if a.endswith("ForSequenceClassification")), None)
        labels = raw.get("num_labels", len(raw.get("id2label") or {}) or 2)
        if kind is None or labels != 1 or not (path / "tokenizer.json").is_file():
            raise ConfigError(f"--reward {folder}: a reward model folder holds a ...ForSequenceClassification with "
                              "num_labels=1 and its tokenizer.json (as `lmkit finetune --task reward` writes it)")
        weights = read_weights(path)
        self.score = weights.pop("score.weight").float()
        raw["architectures"] = [kind.replace("ForSequenceClassification", "ForCausalLM")]
        if raw.get("model_type") == "gpt2":
            raw["architectures"] = ["GPT2LMHeadModel"]
        prefix = "transformer." if raw.get("model_type") == "gpt2" else "model."
        embed = next(v for k, v in weights.items() if k.endswith(("wte.weight", "embed_tokens.weight")))
        if not raw.get("tie_word_embeddings", raw.get("model_type") == "gpt2"):
            weights["lm_head.weight"] = torch.zeros_like(embed)  # never read: the head is `score`
        weights = {k if k.startswith(prefix) or k == "lm_head.weight" else prefix + k: v for k, v in weights.items()}
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(raw), encoding="utf-8")
            write_weights(Path(tmp), weights)
            self.model = load_model(tmp, device=device).eval()
        self.tokenizer = load_tokenizer(path / "tokenizer.json")

    @torch.no_grad()
    def __call__(self, prompts, completions, **_) -> list[float]:
        out = []
        for prompt, completion in zip(prompts, completions):
            if not isinstance(prompt, str):
                raise ConfigError("a reward model scores text prompts here; give --prompts rows with text prompts")
            ids = self.tokenizer.encode(prompt + completion, add_special_tokens=False)
            h = self.model(torch.tensor([ids])).last_hidden_state[0, -1].float()
            out.append(float(h @ self.score[0]))
        return out
