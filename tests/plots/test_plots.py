"""Pictures by their content: the sinusoidal table and RoPE curve follow their formulas, attention maps are the
models' own probabilities (transformers' output_attentions) with rows summing to one, the offline HTML viewer
holds them without a network, the PCA is the top two principal components."""
import json
import math

import numpy as np
import pytest
import torch
import transformers
from matplotlib.image import imread

import lmkit
from lmkit.attention_maps import attention_maps
from lmkit.cli import main
from lmkit.nn.attention import Attention
from lmkit.plots.embeddings import pca_2d
from lmkit.plots.positions import rope_scores


def test_positions_picture_follows_the_formulas(tmp_path):
    out = tmp_path / "positions.png"
    assert main(["plot", "positions", "--out", str(out), "--positions", "40", "--dim", "16", "--base", "100"]) == 0
    image = imread(out)
    assert image.shape[0] > 200 and image.shape[1] > 400 and image[..., :3].std() > 0.05
    data = json.loads(out.with_suffix(".json").read_text())
    table = np.array(data["sinusoidal"])
    i, m = np.arange(40)[:, None], np.arange(8)[None, :]
    np.testing.assert_allclose(table[:, 0::2], np.sin(i / 100 ** (2 * m / 16)), atol=1e-6)
    np.testing.assert_allclose(table[:, 1::2], np.cos(i / 100 ** (2 * m / 16)), atol=1e-6)
    # wavelengths 2 pi base^(2m/d): the first pair turns every 2 pi positions
    np.testing.assert_allclose(table[:, 0], np.sin(np.arange(40)), atol=1e-6)
    curves = {n: np.array(v) for n, v in data["rope"].items()}
    np.testing.assert_allclose(curves["0"], curves["1000"], atol=1e-9)  # only m - n matters
    offsets = np.array(data["offsets"])
    q = np.array(data["q"])  # the picture's pair is k = q: the score peaks at |q|^2 at offset 0
    assert curves["0"][offsets == 0][0] == pytest.approx(q @ q) and curves["0"].argmax() == np.flatnonzero(offsets == 0)[0]


def test_rope_score_is_the_complex_pair_formula():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(8, generator=g), torch.randn(8, generator=g)
    m = torch.arange(-20, 21)
    got = rope_scores(q, k, m + 5, 5, theta=50.0)
    theta = 50.0 ** (-torch.arange(0, 8, 2).double() / 8)
    qc = torch.complex(q[:4].double(), q[4:].double())  # half-split pairs (x_j, x_{j + d/2})
    kc = torch.complex(k[:4].double(), k[4:].double())
    expected = [(qc * kc.conj() * torch.exp(1j * float(o) * theta)).real.sum() for o in m]
    torch.testing.assert_close(got, torch.stack(expected))
    torch.testing.assert_close(got[20], (q.double() @ k.double()))  # offset 0: the plain dot product


def tiny(family, tmp_path):
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=300, n_positions=64)
        model = transformers.GPT2LMHeadModel(cfg)
    elif family == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                                       intermediate_size=48, vocab_size=300, max_position_embeddings=64)
        model = transformers.LlamaForCausalLM(cfg)
    elif family == "bert":
        cfg = transformers.BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=16, intermediate_size=32,
                                      vocab_size=300, max_position_embeddings=64)
        model = transformers.BertModel(cfg)
    elif family == "t5":
        cfg = transformers.T5Config(num_layers=2, num_decoder_layers=2, num_heads=2, d_model=16, d_kv=8, d_ff=32,
                                    vocab_size=300, decoder_start_token_id=0)
        model = transformers.T5ForConditionalGeneration(cfg)
    else:
        cfg = transformers.BartConfig(encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                      decoder_attention_heads=2, d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32,
                                      vocab_size=300, max_position_embeddings=64, decoder_start_token_id=2)
        model = transformers.BartForConditionalGeneration(cfg)
    model.save_pretrained(tmp_path)
    tok = lmkit.train_tokenizer(["attention maps for every family, ünïcode included"] * 8, kind="bpe", vocab_size=300)
    tok.save(tmp_path / "tokenizer.json")
    return tmp_path


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert", "t5", "bart"])
def test_attention_maps_are_the_models_own(tmp_path, family):
    folder = tiny(family, tmp_path)
    ours = lmkit.load_model(folder)
    ref = transformers.AutoModel.from_pretrained(folder, attn_implementation="eager") if family == "bert" else \
        (transformers.AutoModelForSeq2SeqLM if family in ("t5", "bart") else transformers.AutoModelForCausalLM
         ).from_pretrained(folder, attn_implementation="eager")
    ref.eval()
    ids = torch.tensor([[5, 17, 42, 99, 7, 250, 3]])
    with torch.no_grad():
        baseline = ours(ids, **({"decoder_input_ids": ids} if family in ("t5", "bart") else {}))
    maps = attention_maps(ours, ids)
    assert not any(m.keep_probabilities for m in ours.modules() if isinstance(m, Attention))  # off again
    for m in maps.values():
        torch.testing.assert_close(m.sum(-1), torch.ones(m.shape[:-1]))
    kwargs = dict(output_attentions=True)
    if family in ("t5", "bart"):
        start = torch.full((1, 1), ref.config.decoder_start_token_id)
        kwargs["decoder_input_ids"] = torch.cat((start, ids[:, :-1]), 1)
    with torch.no_grad():
        out = ref(ids, **kwargs)
    if family in ("t5", "bart"):
        expected = {**{f"encoder {i + 1} self": a for i, a in enumerate(out.encoder_attentions)},
                    **{f"decoder {i + 1} self": a for i, a in enumerate(out.decoder_attentions)},
                    **{f"decoder {i + 1} cross": a for i, a in enumerate(out.cross_attentions)}}
    else:
        prefix = "encoder" if family == "bert" else "decoder"
        expected = {f"{prefix} {i + 1} self": a for i, a in enumerate(out.attentions)}
        if family != "bert":
            for a in maps.values():  # causal: nothing above the diagonal
                assert torch.all(a.triu(1) == 0)
    assert sorted(maps) == sorted(expected)
    for label, a in expected.items():
        torch.testing.assert_close(maps[label], a, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # the default path still gives the same numbers
        again = ours(ids, **({"decoder_input_ids": ids} if family in ("t5", "bart") else {}))
    first = baseline.logits if baseline.logits is not None else baseline.last_hidden_state
    torch.testing.assert_close(again.logits if again.logits is not None else again.last_hidden_state, first)


@pytest.mark.parametrize("family", ["gpt2", "bart"])
def test_attention_cli_draws_the_grid_and_an_offline_viewer(tmp_path, family):
    folder = tiny(family, tmp_path / "m")
    out = tmp_path / "att.png"
    assert main(["plot", "attention", "--model", str(folder), "--text", "attention ünïcode </script>", "--out", str(out)]) == 0
    image = imread(out)
    assert image.ndim == 3 and image[..., :3].std() > 0.01
    data = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    for label, heads in data["maps"].items():
        heads = np.array(heads)
        np.testing.assert_allclose(heads.sum(-1), 1.0, atol=1e-4)
        assert heads.shape[1:] == (len(data["queries"][label]), len(data["keys"][label]))
    assert main(["plot", "attention", "--model", str(folder), "--text", "ab", "--out", str(tmp_path / "one.png"),
                 "--layers", "2", "--heads", "2"]) == 0
    one = json.loads((tmp_path / "one.json").read_text(encoding="utf-8"))
    assert one["layers"] == [data["layers"][1]] and len(one["maps"][one["layers"][0]]) == 1
    assert main(["plot", "attention", "--model", str(folder), "--text", "ab", "--out", str(tmp_path / "x.png"),
                 "--heads", "9"]) == 2
    page = out.with_suffix(".html").read_text(encoding="utf-8")
    assert "http://" not in page and "https://" not in page and "<script src" not in page
    assert page.count("</script>") == 2  # the text's "</script>" is escaped inside the data block
    block = page.split('<script id="data" type="application/json">')[1].split("</script>")[0]
    viewer = json.loads(block)
    assert viewer["layers"] == data["layers"]
    np.testing.assert_allclose(np.array(viewer["maps"][data["layers"][0]]), np.array(data["maps"][data["layers"][0]]), atol=1e-5)


def test_pca_is_the_top_two_principal_components():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((60, 5)) @ np.diag([5.0, 3.0, 1.0, 0.5, 0.1]) + 7.0
    coords, share = pca_2d(x)
    cov = np.cov(x.T, bias=True)
    values, vectors = np.linalg.eigh(cov)
    np.testing.assert_allclose(coords.var(0), values[::-1][:2], rtol=1e-8)
    np.testing.assert_allclose(share, values[::-1][:2] / values.sum(), rtol=1e-8)
    for axis in range(2):
        v = vectors[:, ::-1][:, axis]
        np.testing.assert_allclose(np.abs(coords[:, axis]), np.abs((x - x.mean(0)) @ v), rtol=1e-6, atol=1e-9)
    assert abs(coords[:, 0] @ coords[:, 1]) < 1e-8


def test_embeddings_cli_for_vectors_and_models(tmp_path):
    from lmkit.embed import WordVectors

    rng = np.random.default_rng(1)
    words = ["straße", "東京", "cat", "dog", "naïve", "x"]
    WordVectors(words, rng.standard_normal((6, 4))).save(tmp_path / "vec")
    out = tmp_path / "pca.png"
    assert main(["plot", "embeddings", "--vectors", str(tmp_path / "vec"), "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    assert data["labels"] == words
    np.testing.assert_allclose(data["coords"], pca_2d(WordVectors.load(tmp_path / "vec").vectors)[0], atol=1e-9)
    assert imread(out)[..., :3].std() > 0.01
    folder = tiny("gpt2", tmp_path / "m")
    assert main(["plot", "embeddings", "--model", str(folder), "--count", "30", "--out", str(tmp_path / "tok.png")]) == 0
    assert len(json.loads((tmp_path / "tok.json").read_text(encoding="utf-8"))["coords"]) == 30
    assert main(["plot", "embeddings", "--vectors", str(tmp_path / "vec"), "--words", "nope", "--out", str(out)]) == 2


def test_lens_picture_through_plot(tmp_path):
    folder = tiny("llama", tmp_path / "m")
    out = tmp_path / "lens.png"
    assert main(["plot", "lens", "--model", str(folder), "--prompt", "attention maps", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    assert data["layers"] == ["embeddings", "layer 1", "layer 2"]
    assert all(0 < p <= 1 for row in data["probabilities"] for p in row) and not math.isnan(imread(out).mean())
