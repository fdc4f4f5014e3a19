"""Seq2SeqLM properties: causal decoder, cross-attention to the source, KV cache, loss, init, presets."""
from __future__ import annotations

import pytest
import torch

import lmkit
from lmkit.config import get_preset
from lmkit.models import build_model
from lmkit.models.seq2seq import Seq2SeqLM
from lmkit.nn import KVCache
from lmkit.objectives import shift_right


def _model(name: str = "t5-tiny", **kw) -> Seq2SeqLM:
    torch.manual_seed(0)
    base = dict(vocab_size=71, d_model=32, n_layers=2, n_decoder_layers=3, n_heads=4, head_dim=8, d_ff=48,
                relative_max_distance=8, relative_buckets=8)
    if name == "bart":
        base.pop("relative_max_distance"), base.pop("relative_buckets")
        base.update(max_seq_len=40, dropout=0.0, pad_token_id=1)
    if name == "t5-tiny":
        base["output_scale"] = 32 ** -0.5
    return build_model(get_preset(name, **{**base, **kw})).eval()


@pytest.mark.parametrize("name", ["t5-tiny", "bart"])
def test_decoder_is_causal_and_reads_the_source(name):
    model = _model(name)
    src = torch.randint(3, 71, (2, 9))
    dec = torch.randint(3, 71, (2, 12))
    with torch.no_grad():
        base = model(src, decoder_input_ids=dec).logits
        changed = dec.clone()
        changed[:, 7] = (changed[:, 7] + 1) % 71
        after = model(src, decoder_input_ids=changed).logits
        assert torch.equal(base[:, :7], after[:, :7])  # position t is blind to t+1..
        assert not torch.allclose(base[:, 7:], after[:, 7:])
        other = src.clone()
        other[:, 0] = (other[:, 0] + 1) % 71
        assert not torch.allclose(model(other, decoder_input_ids=dec).logits[:, 0], base[:, 0])  # cross-attention


@pytest.mark.parametrize("name", ["t5-tiny", "bart"])
def test_kv_cache_gives_the_full_forward(name):
    """One token at a time through the cache (self keys grow, cross keys computed once) = the full pass,
    past the relative-position max distance."""
    model = _model(name)
    src = torch.randint(3, 71, (2, 9))
    mask = torch.ones_like(src)
    mask[1, 5:] = 0
    dec = torch.randint(3, 71, (2, 20))
    with torch.no_grad():
        full = model(src, attention_mask=mask, decoder_input_ids=dec).logits
        cache = KVCache()
        memory = model.encode(src, mask)
        steps = [model(attention_mask=mask, decoder_input_ids=dec[:, :4], encoder_outputs=memory,
                       past_key_values=cache, use_cache=True).logits]
        cross = {k: v[0].data_ptr() for k, v in cache.cross.items()}
        for t in range(4, 20):
            steps.append(model(attention_mask=mask, decoder_input_ids=dec[:, t:t + 1], encoder_outputs=memory,
                               past_key_values=cache, use_cache=True).logits)
        assert {k: v[0].data_ptr() for k, v in cache.cross.items()} == cross  # not recomputed
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_labels_teacher_forcing_loss():
    model = _model()
    src = torch.randint(3, 71, (2, 6))
    labels = torch.randint(3, 71, (2, 5))
    labels[1, 3:] = -100
    out = model(src, labels=labels)
    dec = shift_right(labels, model.decoder_start_token_id, model.config.pad_token_id)
    logits = model(src, decoder_input_ids=dec).logits
    keep = labels != -100
    expected = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
    torch.testing.assert_close(out.loss, expected)
    assert model.decoder_start_token_id == model.config.pad_token_id == 0


def test_t5_init_folds_the_score_scale_into_wq():
    model = build_model(get_preset("t5-tiny"))
    c = model.config
    q = model.encoder.layers[0].self_attn.sublayer.q_proj.weight
    k = model.encoder.layers[0].self_attn.sublayer.k_proj.weight
    assert abs(q.std().item() - (c.d_model * c.resolved_head_dim) ** -0.5) < 0.1 * (c.d_model * c.resolved_head_dim) ** -0.5
    assert abs(k.std().item() - c.d_model ** -0.5) < 0.1 * c.d_model ** -0.5
    assert model.lm_head.weight is model.get_input_embeddings().weight


def test_presets_have_the_reference_sizes():
    with torch.device("meta"):  # sizes only: no memory, no init
        assert build_model(get_preset("t5")).num_parameters() == 60506624  # t5-small
        assert build_model(get_preset("bart")).num_parameters() == 139420416  # bart-base


def test_generate_starts_with_decoder_start_and_saves_as_t5(tmp_path):
    model = _model()
    src = torch.randint(3, 71, (3, 7))
    greedy = model.generate(src, max_new_tokens=6, eos_token_id=1)
    beams = model.generate(src, max_new_tokens=6, num_beams=3, eos_token_id=1)
    assert (greedy[:, 0] == 0).all() and (beams[:, 0] == 0).all()
    model.save_pretrained(tmp_path)
    again = lmkit.load_model(tmp_path)
    assert again.generate(src, max_new_tokens=6, num_beams=3, eos_token_id=1).tolist() == beams.tolist()


def test_generate_arguments():
    model = _model()
    src = torch.randint(3, 71, (2, 5))
    out = model.generate(src, max_new_tokens=3, decoder_start_token_id=7)
    assert (out[:, 0] == 7).all()
    prompt = torch.tensor([[0, 9], [0, 10]])
    out = model.generate(src, max_new_tokens=3, decoder_input_ids=prompt, num_beams=2)
    assert out[:, :2].tolist() == prompt.tolist()
    with pytest.raises(lmkit.LmkitError, match="does not know"):
        model.generate(src, max_new_tokens=3, no_such_option=3)
