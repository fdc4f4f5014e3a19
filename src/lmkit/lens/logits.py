"""The logit lens: read every layer's residual stream of a causal model as next-token predictions.

For the stream h_l after layer l (h_0: the embeddings), logits_l = W_o(norm_f(h_l)) * the model's output
scale, through the model's own final norm and output head (tied to W_E or not); the last layer's lens is the
model's logits. Also read through the input embedding: the nearest token argmin_w ||E(w) - h_l||^2.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lmkit.errors import ConfigError
from lmkit.nn.decoders import nearest_embedding


@dataclass
class LensReading:
    """Per layer (embeddings first) and position: the lens's logits (L + 1, T, V) and nearest input tokens."""

    input_ids: torch.Tensor  # (T,)
    logits: torch.Tensor  # (L + 1, T, V)
    nearest: torch.Tensor  # (L + 1, T)
    names: list[str]
    tied: bool = False  # the output head is W_E: the embeddings row reads back the input token itself

    def top(self, k: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
        """(probabilities, ids) of the k most likely next tokens, each (L + 1, T, k)."""
        p = torch.softmax(self.logits.float(), -1)
        return p.topk(k, dim=-1)


def _causal_parts(model):
    stack, head = getattr(model, "decoder", None), getattr(model, "lm_head", None)
    if stack is None or head is None or not getattr(stack, "causal", False) or not hasattr(stack, "layers"):
        raise ConfigError("the logit lens reads decoder-only (causal) language models; give a CausalLM folder")
    return stack, head


def residual_stream(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """[h_0, h_1, ..., h_L] (each (B, T, d)) of a causal model's stack on input_ids, recorded by hooks."""
    stack, _ = _causal_parts(model)
    states: list[torch.Tensor] = []
    hooks = [stack.embeddings.register_forward_hook(lambda m, a, out: states.append(out))]
    hooks += [layer.register_forward_hook(lambda m, a, out: states.append(out)) for layer in stack.layers]
    try:
        with torch.no_grad():
            model(input_ids, attention_mask=attention_mask)
    finally:
        for h in hooks:
            h.remove()
    return states


def lens_logits(model, h: torch.Tensor) -> torch.Tensor:
    """W_o(norm_f(h)) scaled as the model scales its output: the model's own readout of a stream h."""
    stack, head = _causal_parts(model)
    with torch.no_grad():
        if stack.norm is not None:
            h = stack.norm(h)
        if model.config.output_scale != 1.0:
            h = h * model.config.output_scale
        return head(h)


def logit_lens(model, input_ids: torch.Tensor) -> LensReading:
    """The lens of one sequence input_ids (T,) or (1, T) through every layer, run where the model is; the
    reading comes back on the CPU (for printing and plotting)."""
    ids = input_ids.reshape(1, -1).to(model.device)
    states = residual_stream(model, ids)
    E = model.get_input_embeddings().weight.detach()
    logits = torch.stack([lens_logits(model, h)[0] for h in states])
    nearest = torch.stack([nearest_embedding(h[0].detach(), E) for h in states])
    names = ["embeddings"] + [f"layer {i + 1}" for i in range(len(states) - 1)]
    _, head = _causal_parts(model)
    tied = getattr(head, "weight", None) is not None and head.weight.data_ptr() == E.data_ptr()
    return LensReading(ids[0].cpu(), logits.cpu(), nearest.cpu(), names, tied)
