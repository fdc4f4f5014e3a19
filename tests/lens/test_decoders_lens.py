"""Decoding from embedding space (nearest embedding, softmax decoder) against their formulas; the logit
lens (its last layer is the model's logits, tied or untied heads) and `lmkit lens`."""
import json

import numpy as np
import pytest
import torch
import transformers

import lmkit
from lmkit.cli import main
from lmkit.errors import ConfigError
from lmkit.lens import lens_logits, logit_lens, residual_stream
from lmkit.nn.decoders import nearest_embedding, sample_tokens, softmax_decoder


def brute_nearest(z, E):
    d = ((E[None, :, :].double() - z.reshape(-1, 1, E.shape[1]).double()) ** 2).sum(-1)
    return torch.tensor([min(range(E.shape[0]), key=lambda w: (float(row[w]), w)) for row in d]).view(z.shape[:-1])


@pytest.mark.parametrize("seed", range(4))
def test_nearest_embedding_is_the_argmin_of_squared_distance(seed):
    g = torch.Generator().manual_seed(seed)
    E = torch.randn(37, 9, generator=g)
    z = torch.randn(3, 5, 9, generator=g)  # any batch shape
    assert torch.equal(nearest_embedding(z, E), brute_nearest(z, E))
    assert torch.equal(nearest_embedding(E, E), torch.arange(37))  # a point on an embedding returns that token
    noisy = E + 1e-3 * torch.randn(E.shape, generator=g)
    assert torch.equal(nearest_embedding(noisy, E), torch.arange(37))
    k3 = nearest_embedding(z, E, k=3)
    d = ((E[None, None] - z[:, :, None]) ** 2).sum(-1)
    assert torch.equal(k3[..., 0], nearest_embedding(z, E))
    assert (d.gather(-1, k3).diff(dim=-1) >= 0).all()


def test_nearest_embedding_ties_go_to_the_lowest_id():
    E = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [-1.0, 0.0]])
    assert nearest_embedding(torch.tensor([[1.0, 0.0]]), E).tolist() == [0]  # rows 0 and 2 are the same point
    assert nearest_embedding(torch.tensor([[0.0, 0.0]]), E).tolist() == [0]  # all four at distance 1
    assert nearest_embedding(torch.tensor([[0.0, 0.0]]), E, k=4).tolist() == [[0, 1, 2, 3]]


@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_softmax_decoder_is_softmax_over_normalized_embeddings(temperature):
    g = torch.Generator().manual_seed(0)
    E = torch.randn(23, 6, generator=g) * torch.rand(23, 1, generator=g) * 5  # rows of many lengths
    z = torch.randn(4, 6, generator=g)
    p = softmax_decoder(z, E, temperature=temperature)
    unit = E / E.norm(dim=1, keepdim=True)
    for b in range(4):
        scores = torch.tensor([float(unit[w] @ z[b]) for w in range(23)]) / temperature
        expected = scores.exp() / scores.exp().sum()
        torch.testing.assert_close(p[b], expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(p.sum(-1), torch.ones(4))
    torch.testing.assert_close(softmax_decoder(z, E, temperature=temperature, log=True).exp(), p)
    raw = softmax_decoder(z, E, normalize=False)
    torch.testing.assert_close(raw, torch.softmax(z @ E.T, -1))
    tied = torch.cat([E[:1], E[:1]])  # equal embeddings: equal probabilities
    q = softmax_decoder(z, tied)
    torch.testing.assert_close(q[:, 0], q[:, 1])
    # a unit point on a unit embedding, sharpened, is decoded to that token
    on = unit[7] * 50
    assert int(softmax_decoder(on, E).argmax()) == 7
    draws = sample_tokens(on.expand(100, 6), E, generator=torch.Generator().manual_seed(1))
    assert (draws == 7).float().mean() > 0.9


def gpt2_folder(tmp_path, tie):
    cfg = transformers.GPT2Config(n_layer=3, n_head=2, n_embd=16, vocab_size=300, n_positions=64,
                                  tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    if not tie:
        with torch.no_grad():
            model.lm_head.weight.normal_()
    model.save_pretrained(tmp_path)
    tok = lmkit.train_tokenizer(["the lens reads every layer, layer by layer: ünïcödé too"] * 8, kind="bpe", vocab_size=300)
    tok.save(tmp_path / "tokenizer.json")
    return tmp_path


def llama_folder(tmp_path):
    cfg = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                                   intermediate_size=48, vocab_size=120, max_position_embeddings=64,
                                   tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("kind", ["gpt2-tied", "gpt2-untied", "llama-untied"])
def test_the_last_layers_lens_is_the_models_logits(tmp_path, kind):
    folder = llama_folder(tmp_path) if kind.startswith("llama") else gpt2_folder(tmp_path, kind == "gpt2-tied")
    model = lmkit.load_model(folder)
    ids = torch.randint(0, 100, (11,), generator=torch.Generator().manual_seed(2))
    reading = logit_lens(model, ids)
    L = model.config.n_layers
    assert reading.logits.shape == (L + 1, 11, model.config.vocab_size) and reading.names[0] == "embeddings"
    with torch.no_grad():
        logits = model(ids[None]).logits[0]
    torch.testing.assert_close(reading.logits[-1], logits, rtol=1e-5, atol=1e-5)
    states = residual_stream(model, ids[None])
    assert len(states) == L + 1
    E = model.get_input_embeddings().weight
    torch.testing.assert_close(states[0][0], model.decoder.embeddings(ids[None])[0])
    # each layer's lens is norm_f then the head, by hand
    for l in range(L + 1):
        by_hand = model.lm_head(model.decoder.norm(states[l])) if model.decoder.norm is not None else model.lm_head(states[l])
        torch.testing.assert_close(reading.logits[l], by_hand[0].detach(), rtol=1e-5, atol=1e-5)
        assert torch.equal(reading.nearest[l], brute_nearest(states[l][0].detach(), E.detach()))
    torch.testing.assert_close(lens_logits(model, states[-1])[0], logits, rtol=1e-5, atol=1e-5)
    if kind.startswith("llama"):  # no position added: the stream starts as the token's own embedding
        assert torch.equal(reading.nearest[0], ids)


def test_the_lens_refuses_an_encoder(tmp_path):
    cfg = transformers.BertConfig(num_hidden_layers=1, num_attention_heads=2, hidden_size=16, intermediate_size=32,
                                  vocab_size=50, max_position_embeddings=32)
    transformers.BertModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="causal"):
        logit_lens(lmkit.load_model(tmp_path), torch.tensor([1, 2, 3]))


def test_lens_cli_prints_every_layer_and_draws_the_grid(tmp_path, capsys):
    folder = gpt2_folder(tmp_path / "m", tie=True)
    out = tmp_path / "lens.png"
    assert main(["lens", "--model", str(folder), "--prompt", "the lens reads ünïcödé", "--out", str(out), "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "embeddings:" in text and "layer 3:" in text
    from matplotlib.image import imread

    image = imread(out)
    assert image.ndim == 3 and image.shape[0] > 100 and image[..., :3].std() > 0.01
    data = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    model, tok = lmkit.load_model(folder), lmkit.load_tokenizer(folder)
    ids = tok.encode("the lens reads ünïcödé")
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([ids])).logits[0], -1)
    assert data["tokens"][-1] == [tok.decode([int(i)]) for i in probs.argmax(-1)]
    np.testing.assert_allclose(data["probabilities"][-1], probs.max(-1).values.tolist(), rtol=1e-5)
    # tied: the embeddings row (each input token predicting itself) is printed but left out of the picture
    assert data["layers"] == ["layer 1", "layer 2", "layer 3"] and "".join(data["inputs"]) == tok.decode(ids)
