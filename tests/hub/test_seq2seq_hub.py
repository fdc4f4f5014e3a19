"""T5 and BART: lmkit.load_model on folders transformers wrote gives the same logits, and back."""
from __future__ import annotations

import json

import pytest
import torch

import lmkit
from lmkit.models.seq2seq import Seq2SeqLM

transformers = pytest.importorskip("transformers")

V = 61


def _t5(gated: bool, tied: bool, **kw):
    cfg = transformers.T5Config(vocab_size=V, d_model=24, d_kv=5, d_ff=37, num_layers=2, num_decoder_layers=3,
                                num_heads=3, relative_attention_num_buckets=8, relative_attention_max_distance=12,
                                feed_forward_proj="gated-gelu" if gated else "relu", tie_word_embeddings=tied,
                                decoder_start_token_id=0, dropout_rate=0.0, **kw)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    if not tied:  # a v1.1 / flan checkpoint: its own head, distinct from the shared table
        model.lm_head.weight = torch.nn.Parameter(torch.randn(V, 24) * 0.3)
    return model


def _bart(scale: bool = False):
    cfg = transformers.BartConfig(vocab_size=V, d_model=24, encoder_layers=2, decoder_layers=3,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=40,
                                  decoder_ffn_dim=40, max_position_embeddings=64, scale_embedding=scale, dropout=0.0)
    return perturbed(transformers.BartForConditionalGeneration, cfg)


def perturbed(model_class, cfg):
    """A BART-like model built with seed 0 whose final_logits_bias is not zero (so that it must be carried over)
    and whose layer norms are away from (1, 0)."""
    torch.manual_seed(0)
    model = model_class(cfg).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_()
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _inputs(pad: int, start: int):
    torch.manual_seed(1)
    src = torch.randint(3, V, (3, 11))
    mask = torch.ones_like(src)
    mask[1, 7:] = 0  # a padded source row
    mask[2, 4:] = 0
    src = src.masked_fill(mask == 0, pad)
    dec = torch.randint(3, V, (3, 30))  # longer than relative_attention_max_distance (12)
    dec[:, 0] = start
    return src, mask, dec


def _compare(hf_model, folder, pad, start):
    hf_model.save_pretrained(folder)
    ours = lmkit.load_model(folder)
    assert isinstance(ours, Seq2SeqLM)
    src, mask, dec = _inputs(pad, start)
    with torch.no_grad():
        ref = hf_model(input_ids=src, attention_mask=mask, decoder_input_ids=dec)
        out = ours(src, attention_mask=mask, decoder_input_ids=dec)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
    keep = mask.bool()
    torch.testing.assert_close(out.encoder_last_hidden_state[keep], ref.encoder_last_hidden_state[keep],
                               atol=1e-4, rtol=1e-4)
    return ours, src, mask, dec


@pytest.mark.parametrize("gated,tied", [(False, True), (True, False)], ids=["t5-v1.0", "t5-v1.1"])
def test_t5_logits_match_transformers(tmp_path, gated, tied):
    hf_model = _t5(gated, tied)
    ours, src, mask, dec = _compare(hf_model, tmp_path / "hf", 0, 0)
    assert ours.config.tie_embeddings == tied
    assert (ours.lm_head.weight is ours.get_input_embeddings().weight) == tied
    # and back: transformers reads what lmkit writes
    ours.save_pretrained(tmp_path / "ours")
    again = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=src, attention_mask=mask, decoder_input_ids=dec).logits,
                                   ours(src, attention_mask=mask, decoder_input_ids=dec).logits, atol=1e-4, rtol=1e-4)


def test_t5_4x_style_config(tmp_path):
    """A transformers 4.x v1.1 folder: tie_word_embeddings=false, no scale_decoder_outputs, lm_head stored."""
    hf_model = _t5(True, False)
    hf_model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("scale_decoder_outputs", None)
    raw["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = lmkit.load_model(tmp_path)
    src, mask, dec = _inputs(0, 0)
    with torch.no_grad():
        torch.testing.assert_close(ours(src, attention_mask=mask, decoder_input_ids=dec).logits,
                                   hf_model(input_ids=src, attention_mask=mask, decoder_input_ids=dec).logits,
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scale", [False, True], ids=["bart", "bart-scaled-embeddings"])
def test_bart_logits_match_transformers(tmp_path, scale):
    hf_model = _bart(scale)
    ours, src, mask, dec = _compare(hf_model, tmp_path / "hf", 1, 2)
    ours.save_pretrained(tmp_path / "ours")
    again = transformers.BartForConditionalGeneration.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=src, attention_mask=mask, decoder_input_ids=dec).logits,
                                   ours(src, attention_mask=mask, decoder_input_ids=dec).logits, atol=1e-4, rtol=1e-4)


def test_bart_without_final_logits_bias(tmp_path):
    """BartModel-like folders may lack final_logits_bias; transformers then uses zeros, and so does lmkit."""
    from safetensors.torch import load_file, save_file

    hf_model = _bart()
    with torch.no_grad():
        hf_model.final_logits_bias.zero_()
    hf_model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors.pop("final_logits_bias")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = lmkit.load_model(tmp_path)
    src, mask, dec = _inputs(1, 2)
    with torch.no_grad():
        torch.testing.assert_close(ours(src, attention_mask=mask, decoder_input_ids=dec).logits,
                                   hf_model(input_ids=src, attention_mask=mask, decoder_input_ids=dec).logits,
                                   atol=1e-4, rtol=1e-4)


def test_bart_base_style_config():
    """The keys of facebook/bart-base's config.json (legacy flags included) map onto the bart preset."""
    from lmkit.config import get_preset
    from lmkit.errors import ConfigError
    from lmkit.hub.bart import config_from_hf

    raw = {"activation_function": "gelu", "add_bias_logits": False, "add_final_layer_norm": False, "d_model": 768,
           "decoder_attention_heads": 12, "decoder_ffn_dim": 3072, "decoder_layers": 6, "encoder_attention_heads": 12,
           "encoder_ffn_dim": 3072, "encoder_layers": 6, "max_position_embeddings": 1024, "model_type": "bart",
           "normalize_before": False, "normalize_embedding": True, "scale_embedding": False, "vocab_size": 50265,
           "forced_bos_token_id": 0, "forced_eos_token_id": 2, "pad_token_id": 1, "bos_token_id": 0,
           "eos_token_id": 2, "decoder_start_token_id": 2, "static_position_embeddings": False, "dropout": 0.1,
           "attention_dropout": 0.1, "activation_dropout": 0.1}
    cfg = config_from_hf(raw)
    preset = get_preset("bart")
    for field in ("d_model", "n_layers", "decoder_layers", "n_heads", "d_ff", "max_seq_len", "position_offset",
                  "norm_placement", "embedding_norm", "final_norm", "activation", "output_bias", "decoder_start_token_id",
                  "dropout", "attention_dropout", "activation_dropout"):
        assert getattr(cfg, field) == getattr(preset, field), field
    assert cfg.extra == {"forced_bos_token_id": 0, "forced_eos_token_id": 2}
    with pytest.raises(ConfigError, match="encoder_ffn_dim=3072 != decoder_ffn_dim=4096"):
        config_from_hf({**raw, "decoder_ffn_dim": 4096})


def test_bart_legacy_layout_keys_are_ignored_as_transformers_does(tmp_path):
    """transformers' BART reads none of normalize_before / add_final_layer_norm / ... (mBART's values of them
    included) and starts generation from bos_token_id when decoder_start_token_id is null: so does lmkit."""
    hf_model = _bart()
    hf_model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(normalize_before=True, add_final_layer_norm=True, normalize_embedding=False, add_bias_logits=True,
               static_position_embeddings=True, decoder_start_token_id=None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "generation_config.json").unlink()
    ref = transformers.BartForConditionalGeneration.from_pretrained(tmp_path).eval()
    ours = lmkit.load_model(tmp_path)
    assert ours.config.norm_placement == "post" and not ours.config.final_norm
    src, mask, dec = _inputs(1, 2)
    with torch.no_grad():
        torch.testing.assert_close(ours(src, attention_mask=mask, decoder_input_ids=dec).logits,
                                   ref(input_ids=src, attention_mask=mask, decoder_input_ids=dec).logits,
                                   atol=1e-4, rtol=1e-4)
    got = ours.generate(src, attention_mask=mask, max_new_tokens=5)
    assert got.tolist() == ref.generate(src, attention_mask=mask, max_new_tokens=5, do_sample=False).tolist()
    assert (got[:, 0] == ref.config.bos_token_id).all()


def test_t5_small_and_flan_style_configs():
    from lmkit.config import get_preset
    from lmkit.hub.t5 import config_from_hf

    t5_small = {"d_ff": 2048, "d_kv": 64, "d_model": 512, "decoder_start_token_id": 0, "dropout_rate": 0.1,
                "eos_token_id": 1, "initializer_factor": 1.0, "layer_norm_epsilon": 1e-06, "model_type": "t5",
                "n_positions": 512, "num_heads": 8, "num_layers": 6, "pad_token_id": 0,
                "relative_attention_num_buckets": 32, "vocab_size": 32128}
    cfg, preset = config_from_hf(t5_small), get_preset("t5")
    for field in ("d_model", "n_layers", "decoder_layers", "n_heads", "resolved_head_dim", "d_ff", "activation", "norm", "norm_eps",
                  "attention_scale", "tie_embeddings", "output_scale", "relative_buckets", "relative_max_distance",
                  "decoder_start_token_id", "pad_token_id", "eos_token_id", "dropout", "activation_dropout"):
        assert getattr(cfg, field) == getattr(preset, field), field
    flan = {**t5_small, "d_ff": 1024, "num_heads": 6, "num_layers": 8, "num_decoder_layers": 8,
            "feed_forward_proj": "gated-gelu", "dense_act_fn": "gelu_new", "is_gated_act": True,
            "tie_word_embeddings": False}
    cfg = config_from_hf(flan)
    assert cfg.activation == "geglu_tanh" and not cfg.tie_embeddings and cfg.output_scale == 1.0
    assert cfg.decoder_layers == 8 and cfg.n_heads * cfg.resolved_head_dim == 384


def test_bart_untied_has_a_token_table_per_stack(tmp_path):
    """transformers 5 unties BART's encoder and decoder token tables from `shared` (and the head) when
    tie_word_embeddings is false: each stack reads its own table, and the folder we write keeps all of them."""
    cfg = transformers.BartConfig(vocab_size=V, d_model=24, encoder_layers=2, decoder_layers=3,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=40,
                                  decoder_ffn_dim=40, max_position_embeddings=64, dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.BartForConditionalGeneration(cfg).eval()
    assert not torch.equal(hf.model.encoder.embed_tokens.weight, hf.model.decoder.embed_tokens.weight)
    ours, src, mask, dec = _compare(hf, tmp_path / "hf", cfg.pad_token_id, cfg.decoder_start_token_id)
    ours.save_pretrained(tmp_path / "ours")
    back = transformers.BartForConditionalGeneration.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=src, attention_mask=mask, decoder_input_ids=dec).logits,
                                   hf(input_ids=src, attention_mask=mask, decoder_input_ids=dec).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fields", [dict(feed_forward_proj="gated-gelu", dense_act_fn="gelu"),
                                    dict(feed_forward_proj="relu", dense_act_fn="gelu_new", is_gated_act=True),
                                    dict(feed_forward_proj="gated-silu", is_gated_act=False)],
                         ids=["gated-exact-gelu", "gated-by-flag", "ungated-by-flag"])
def test_t5_dense_act_fn_and_is_gated_act_win(tmp_path, fields):
    """transformers runs config.json's dense_act_fn / is_gated_act over what feed_forward_proj says; so does lmkit,
    and what lmkit saves (exact-GELU gating included) loads back in transformers with the same logits."""
    cfg = transformers.T5Config(vocab_size=V, d_model=16, d_kv=4, d_ff=20, num_layers=1, num_heads=2,
                                decoder_start_token_id=0, dropout_rate=0.0, **fields)
    torch.manual_seed(0)
    hf_model = transformers.T5ForConditionalGeneration(cfg).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**raw, **fields}))
    hf_model = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    ours = lmkit.load_model(tmp_path / "hf")
    src, mask, dec = _inputs(0, 0)
    with torch.no_grad():
        logits = ours(src, attention_mask=mask, decoder_input_ids=dec).logits
        torch.testing.assert_close(logits, hf_model(input_ids=src, attention_mask=mask, decoder_input_ids=dec).logits,
                                   atol=1e-4, rtol=1e-4)
        ours.save_pretrained(tmp_path / "ours")
        again = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "ours").eval()
        torch.testing.assert_close(again(input_ids=src, attention_mask=mask, decoder_input_ids=dec).logits, logits,
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("own_head", [True, False], ids=["own-head", "head-is-shared"])
def test_mt5_loads_unscaled_and_round_trips(tmp_path, own_head):
    """mT5 (model_type mt5): v1.1's math whatever tie_word_embeddings says (transformers forces it true and never
    scales); its own lm_head when stored, else the shared table; saved back as an MT5 folder."""
    cfg = transformers.MT5Config(vocab_size=V, d_model=24, d_kv=5, d_ff=37, num_layers=2, num_decoder_layers=1,
                                 num_heads=3, relative_attention_num_buckets=8, relative_attention_max_distance=12,
                                 dropout_rate=0.0)
    torch.manual_seed(0)
    hf_model = transformers.MT5ForConditionalGeneration(cfg).eval()
    if own_head:
        hf_model.lm_head.weight = torch.nn.Parameter(torch.randn(V, 24) * 0.3)
    ours, src, mask, dec = _compare(hf_model, tmp_path / "hf", 0, 0)
    assert ours.config.output_scale == 1.0
    ours.save_pretrained(tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == "mt5"
    again = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ours").eval()
    assert type(again) is transformers.MT5ForConditionalGeneration
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=src, attention_mask=mask, decoder_input_ids=dec).logits,
                                   ours(src, attention_mask=mask, decoder_input_ids=dec).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["umt5", "longt5", "marian", "pegasus"])
def test_t5_and_bart_relatives_are_refused(tmp_path, model_type):
    from lmkit.errors import ConfigError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "d_model": 8}))
    with pytest.raises(ConfigError, match=f"model_type '{model_type}'"):
        lmkit.load_model(tmp_path)


def test_dropout_settings_travel_as_transformers_reads_them(tmp_path):
    """T5 drops inside its FFN at dropout_rate; BART has its own activation_dropout; GPT-2, BERT and LLaMA drop
    nothing inside the FFN. Saved folders keep the settings."""
    from lmkit.hub.bart import config_from_hf as bart_config
    from lmkit.hub.bert import config_from_hf as bert_config
    from lmkit.hub.gpt2 import config_from_hf as gpt2_config
    from lmkit.hub.t5 import config_from_hf as t5_config

    t5 = t5_config({"model_type": "t5", "dropout_rate": 0.15})
    assert (t5.dropout, t5.activation_dropout, t5.attention_dropout) == (0.15, 0.15, 0.0)
    hf = _bart()
    hf.config.update(dict(dropout=0.1, attention_dropout=0.2, activation_dropout=0.3))
    hf.save_pretrained(tmp_path / "bart")
    cfg = lmkit.load_model(tmp_path / "bart").config
    assert (cfg.dropout, cfg.attention_dropout, cfg.activation_dropout) == (0.1, 0.2, 0.3)
    lmkit.load_model(tmp_path / "bart").save_pretrained(tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert (saved["dropout"], saved["attention_dropout"], saved["activation_dropout"]) == (0.1, 0.2, 0.3)
    assert bart_config({"model_type": "bart"}).activation_dropout == 0.0  # BartConfig's default
    assert gpt2_config({"model_type": "gpt2", "resid_pdrop": 0.1}).activation_dropout == 0.0
    assert bert_config({"model_type": "bert", "hidden_dropout_prob": 0.1}).activation_dropout == 0.0
