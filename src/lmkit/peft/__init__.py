"""Parameter-efficient fine-tuning: LoRA, QLoRA, prefix tuning, prompt tuning, bottleneck adapters, IA3."""
from lmkit.peft.adapters import BottleneckAdapter, IA3Linear, apply_adapters, apply_ia3
from lmkit.peft.io import load_adapter, lora_weights
from lmkit.peft.lora import LoRALinear, apply_lora, merge_and_unload, merge_lora, unmerge_lora
from lmkit.peft.model import METHODS, PeftConfig, PeftModel, format_summary, get_peft_model, trainable_summary
from lmkit.peft.prompt import PrefixAttention, PromptEmbedding, apply_prefix, apply_prompt
from lmkit.peft.quant import QuantizedLinear, quantize_linears
from lmkit.peft.save import save_adapter

__all__ = [
    "BottleneckAdapter", "IA3Linear", "apply_adapters", "apply_ia3", "load_adapter", "lora_weights", "save_adapter", "LoRALinear",
    "apply_lora", "merge_and_unload", "merge_lora", "unmerge_lora", "METHODS", "PeftConfig", "PeftModel",
    "format_summary", "get_peft_model", "trainable_summary", "PrefixAttention", "PromptEmbedding", "apply_prefix",
    "apply_prompt", "QuantizedLinear", "quantize_linears",
]
