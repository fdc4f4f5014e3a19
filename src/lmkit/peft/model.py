"""`get_peft_model(model, method, ...)`: freeze a model and add one parameter-efficient method to it.

Methods: lora, qlora (LoRA on 4- or 8-bit block-quantized linear layers), prefix, prompt,
adapter (bottleneck), ia3. All act on the shared building blocks, so they work on every family.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from lmkit.errors import ConfigError
from lmkit.peft import adapters, lora, prompt, quant
from lmkit.peft.names import ADAPTER_PARAMS, hf_names, matches, own_copy, parameter_owners
from lmkit.peft.save import save_adapter

METHODS = ("lora", "qlora", "prefix", "prompt", "adapter", "ia3")


@dataclass
class PeftConfig:
    """Settings of one method; fields that a method does not use are ignored."""

    method: str = "lora"
    target_modules: list[str] | str | None = None   # None: q_proj, v_proj (LoRA); k_proj, v_proj, down_proj (IA3)
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    use_rslora: bool = False                         # lora: scale alpha / sqrt(r) instead of alpha / r
    bits: int = 4                                    # qlora: 4 (NF4) or 8 (int8)
    block_size: int = 64
    double_quant: bool = False                       # qlora: the NF4 block scales themselves in 8 bits (QLoRA's DQ)
    num_virtual_tokens: int = 10                     # prefix, prompt
    bottleneck: int = 16                             # adapter
    feedforward_modules: list[str] = field(default_factory=lambda: ["down_proj"])   # ia3
    modules_to_save: list[str] = field(default_factory=list)   # trained in full (e.g. a classification head)
    bias: str = "none"                               # lora: also train biases, "all" or "lora_only" (PEFT's)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown PEFT method {self.method!r}; choose one of {', '.join(METHODS)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout (--lora-dropout) is a probability in [0, 1), got {self.dropout}")
        if self.bias not in ("none", "all", "lora_only") or (self.bias != "none" and self.method not in ("lora", "qlora")):
            raise ConfigError(f"bias is 'none', 'all' or 'lora_only' (LoRA only, as in PEFT), got {self.bias!r} for "
                              f"{self.method}")
        used = {"prefix": "num_virtual_tokens (--virtual-tokens)", "prompt": "num_virtual_tokens (--virtual-tokens)",
                "adapter": "bottleneck (--bottleneck)"}.get(self.method)
        if used and getattr(self, used.split()[0]) < 1:  # zero would train nothing (or fail deep in autograd)
            raise ConfigError(f"{used} must be at least 1 for {self.method}, got {getattr(self, used.split()[0])}")

    def to_dict(self) -> dict:
        return asdict(self)


class PeftModel(nn.Module):
    """A frozen base model with one method's parameters; forward and generate as the base's."""

    def __init__(self, model: nn.Module, config: PeftConfig, targets: list[str] | None = None):
        """Add the method to `model` (in place), unless `targets` says it was added already (loading)."""
        super().__init__()
        self.base_model = model
        self.peft_config = config
        c = config
        if targets is not None:
            self.targets = targets
        elif c.method in ("lora", "qlora"):
            if c.method == "qlora":
                quant.quantize_linears(model, c.bits, c.block_size, skip=_head_names(model, c),
                                      double_quant=c.double_quant)
            self.targets = lora.apply_lora(model, c.target_modules or ["q_proj", "v_proj"], c.r, c.alpha, c.dropout,
                                           c.use_rslora)
        elif c.method == "prefix":
            self.targets = prompt.apply_prefix(model, c.num_virtual_tokens)
        elif c.method == "prompt":
            self.targets = prompt.apply_prompt(model, c.num_virtual_tokens)
        elif c.method == "adapter":
            self.targets = adapters.apply_adapters(model, c.bottleneck)
        else:
            self.targets = adapters.apply_ia3(model, c.target_modules or ["k_proj", "v_proj", "down_proj"],
                                              c.feedforward_modules)
        untie_saved(model, c.modules_to_save)
        mark_trainable(model, c.modules_to_save, c.bias)

    @property
    def config(self):
        return self.base_model.config

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base_model":
                raise
            return getattr(self.base_model, name)

    # prompt tuning puts virtual tokens (ids vocab_size..) in front of the inputs ------------------------
    def _virtual(self, input_ids: torch.Tensor) -> torch.Tensor:
        P, V = self.peft_config.num_virtual_tokens, self.config.vocab_size
        return torch.arange(V, V + P, device=input_ids.device).expand(input_ids.shape[0], P)

    def _with_prompt(self, kwargs: dict) -> dict:
        ids = kwargs["input_ids"]
        virtual = self._virtual(ids)
        kwargs["input_ids"] = torch.cat([virtual, ids], dim=1)
        # labels of an encoder-decoder model belong to the decoder, which gets no virtual tokens
        decoder_only = self.config.architecture == "decoder"
        keys = (("attention_mask", 1), ("token_type_ids", 0)) + ((("labels", -100),) if decoder_only else ())
        for key, fill in keys:
            if kwargs.get(key) is not None and kwargs[key].dim() == 2 and kwargs[key].shape[1] == ids.shape[1]:
                kwargs[key] = torch.cat([torch.full_like(virtual, fill).to(kwargs[key].dtype), kwargs[key]], dim=1)
        if kwargs.get("attention_mask") is None and "attention_mask" in kwargs:
            kwargs.pop("attention_mask")
        return kwargs

    def forward(self, input_ids: torch.Tensor | None = None, **kwargs):
        if self.peft_config.method != "prompt" or input_ids is None:
            return self.base_model(input_ids, **kwargs)
        T = input_ids.shape[1]
        out = self.base_model(**self._with_prompt({"input_ids": input_ids, **kwargs}))
        if self.config.architecture == "encoder-decoder":
            return out
        P = self.peft_config.num_virtual_tokens
        if out.logits is not None and out.logits.dim() == 3 and out.logits.shape[1] == T + P:
            out.logits = out.logits[:, P:]          # the scores of the real positions only
        if out.last_hidden_state is not None and out.last_hidden_state.shape[1] == T + P:
            out.last_hidden_state = out.last_hidden_state[:, P:]
        return out

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        if self.peft_config.method != "prompt":
            return self.base_model.generate(input_ids, attention_mask=attention_mask, **kwargs)
        args = self._with_prompt({"input_ids": input_ids, "attention_mask": attention_mask})
        out = self.base_model.generate(args["input_ids"], attention_mask=args.get("attention_mask"), **kwargs)
        if self.config.architecture == "encoder-decoder":
            return out  # decoder ids: the virtual tokens were only in the encoder's input
        return out[:, self.peft_config.num_virtual_tokens:]

    # merging (LoRA) and summaries ---------------------------------------------------------------------
    def merge(self) -> None:
        lora.merge_lora(self.base_model)

    def unmerge(self) -> None:
        lora.unmerge_lora(self.base_model)

    def merge_and_unload(self) -> nn.Module:
        """The base model with each LoRA update (or IA3 scale) folded into its layer."""
        if self.peft_config.method not in ("lora", "qlora", "ia3"):
            raise ConfigError(f"merge_and_unload applies to LoRA and IA3; method {self.peft_config.method} adds "
                              "computation that cannot be folded into the weights")
        if self.peft_config.method == "ia3":
            model = adapters.merge_ia3(self.base_model)
        else:
            model = lora.merge_and_unload(self.base_model)
        for p in model.parameters():
            p.requires_grad_(True)
        return model

    def trainable_summary(self) -> dict:
        return trainable_summary(self.base_model)

    def save_adapter(self, path) -> None:
        save_adapter(self, path)


def _head_names(model: nn.Module, config: PeftConfig) -> tuple[str, ...]:
    """Layers QLoRA keeps in full precision: the output head and anything trained in full."""
    return ("lm_head", *config.modules_to_save)


def mark_trainable(model: nn.Module, modules_to_save=(), bias: str = "none") -> None:
    """requires_grad only for the methods' parameters, the modules listed in modules_to_save and, as PEFT's
    LoRA `bias` does, every parameter named `bias` ("all") or the LoRA layers' biases ("lora_only")."""
    names = hf_names(model)
    lora_modules = {names.get(n, n) for n in lora.lora_layers(model)}  # HF names: GPT-2's c_attn for q, k, v
    for name, p in model.named_parameters():
        module, _, attr = name.rpartition(".")
        hf = names.get(module.removesuffix(".base_layer"), module.removesuffix(".base_layer"))
        keep = any(f".{a}" in f".{name}" for a in ADAPTER_PARAMS) or _to_save(module, modules_to_save, names)
        keep = keep or (attr == "bias" and (bias == "all" or (bias == "lora_only" and hf in lora_modules)))
        p.requires_grad_(keep)


def _to_save(module: str, modules_to_save, names: dict[str, str]) -> bool:
    """Whether lmkit module `module` lies in one of modules_to_save, by its name or its HF name."""
    if not modules_to_save:
        return False
    hf = names.get(module)  # a module inside an HF module to save (RoBERTa's pooler is classifier.dense)
    # PEFT matches modules_to_save by a bare endswith: "classifier" also takes DistilBERT's pre_classifier
    peft_suffix = [m for m in ([modules_to_save] if isinstance(modules_to_save, str) else modules_to_save)
                   if not m.startswith("re:")]
    return (any(matches(m, modules_to_save, names.get(m)) for m in _prefixes(module))
            or (hf is not None and any(matches(h, modules_to_save) or h.endswith(tuple(peft_suffix))
                                       for h in _prefixes(hf))))


def untie_saved(model: nn.Module, modules_to_save=()) -> None:
    """Give a module to save its own copy of a weight it shares (a tied LM head), as PEFT trains a copy of it:
    training the head then leaves the input embedding as it was."""
    if not modules_to_save:
        return
    names = hf_names(model)
    for shared in (o for o in parameter_owners(model).values() if len(o) > 1):
        saved = [n for n in shared if _to_save(n.rpartition(".")[0], modules_to_save, names)]
        # the original stays with a module not to save (else with the first); the others get copies
        keep = next((n for n in shared if n not in saved), shared[0])
        for name in saved:
            if name != keep:
                module, _, attr = name.rpartition(".")
                own_copy(model, model.get_submodule(module), attr)


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def trainable_summary(model: nn.Module) -> dict:
    """{trainable, total, percent}: distinct parameters (tied ones once), quantized weights counted as stored values."""
    seen: dict[int, nn.Parameter] = {}
    for p in model.parameters():
        seen.setdefault(id(p), p)
    trainable = sum(p.numel() for p in seen.values() if p.requires_grad)
    total = sum(p.numel() for p in seen.values())
    total += sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, quant.QuantizedLinear))
    return {"trainable": trainable, "total": total, "percent": 100.0 * trainable / max(total, 1)}


def format_summary(s: dict) -> str:
    return f"trainable params: {s['trainable']:,} || all params: {s['total']:,} || trainable%: {s['percent']:.4f}"


def get_peft_model(model: nn.Module, method: str | PeftConfig = "lora", **settings) -> PeftModel:
    """Freeze `model` and add the method (`PeftConfig` fields as keyword settings)."""
    config = method if isinstance(method, PeftConfig) else PeftConfig(method=method, **settings)
    return PeftModel(model, config)
