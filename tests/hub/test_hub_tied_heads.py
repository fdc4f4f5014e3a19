"""A folder whose config.json ties the head to the token table but whose weights also hold the head with other
values: transformers 5 then leaves the head untied (its warning: "both are present in the checkpoints with
different values, so we will NOT tie them"), and lmkit loads the same numbers. Equal values stay tied."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import lmkit

transformers = pytest.importorskip("transformers")

V = 48


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2,
                                                                 n_positions=32)), "lm_head.weight"


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg), "lm_head.weight"


def _bert():
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                  num_attention_heads=2, max_position_embeddings=32)
    return transformers.BertForMaskedLM(cfg), "cls.predictions.decoder.weight"


def _t5():
    cfg = transformers.T5Config(vocab_size=V, d_model=16, d_kv=4, d_ff=24, num_layers=1, num_heads=2,
                                decoder_start_token_id=0, tie_word_embeddings=True)
    return transformers.T5ForConditionalGeneration(cfg), "lm_head.weight"


def _bart():
    cfg = transformers.BartConfig(vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                  decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24,
                                  max_position_embeddings=32)
    return transformers.BartForConditionalGeneration(cfg), "lm_head.weight"


def _logits(model, ids, seq2seq: bool):
    with torch.no_grad():
        if seq2seq:
            return model(input_ids=ids, decoder_input_ids=ids[:, :4]).logits
        return model(input_ids=ids).logits


@pytest.mark.parametrize("build", [_gpt2, _llama, _bert, _t5, _bart], ids=lambda f: f.__name__[1:])
@pytest.mark.parametrize("same", [False, True], ids=["other-values", "same-values"])
def test_a_stored_head_with_other_values_is_untied_as_transformers(build, same, tmp_path):
    torch.manual_seed(0)
    hf_model, head = build()
    hf_model.eval().save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    assert head not in weights  # transformers 5 writes a tied table once
    table = hf_model.get_input_embeddings().weight.detach()
    weights[head] = table.clone() if same else torch.randn_like(table)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})

    ref = type(hf_model).from_pretrained(tmp_path).eval()
    ours = lmkit.load_model(tmp_path)
    assert ours.config.tie_embeddings is same
    assert (ref.get_output_embeddings().weight is ref.get_input_embeddings().weight) is same
    ids = torch.randint(3, V, (2, 7))
    seq2seq = ref.config.is_encoder_decoder
    torch.testing.assert_close(_logits(ours, ids, seq2seq), _logits(ref, ids, seq2seq), atol=1e-4, rtol=1e-4)
