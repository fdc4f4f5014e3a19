"""The model families, assembled from `lmkit.nn` and configured by `ModelConfig`."""
from lmkit.config import ModelConfig
from lmkit.models.base import PreTrainedModel
from lmkit.models.causal_lm import CausalLM
from lmkit.models.encoder import Encoder
from lmkit.models.output import ModelOutput
from lmkit.models.seq2seq import Seq2SeqLM
from lmkit.models.stack import Stack
from lmkit.models.xlnet import XLNet


def build_model(config: ModelConfig) -> PreTrainedModel:
    """A fresh model of the class that config.architecture names (XLNet for Transformer-XL positions)."""
    if config.position == "xl":
        return XLNet(config)
    if config.architecture == "decoder":
        return CausalLM(config)
    if config.architecture == "encoder":
        return Encoder(config)

    return Seq2SeqLM(config)


__all__ = ["CausalLM", "ModelOutput", "PreTrainedModel", "Stack", "build_model"]
