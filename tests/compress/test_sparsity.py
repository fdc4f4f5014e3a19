"""Unstructured magnitude pruning: the masks zero exactly the smallest weights (globally or per layer), the cubic
schedule is Zhu and Gupta's, gradual pruning ends at its sparsity and keeps pruned weights at zero while training,
and `lmkit prune --unstructured` saves a folder transformers loads with the same logits."""
import json

import pytest
import torch

import lmkit
from lmkit.cli import main
from lmkit.compress.sparsity import (GradualPruning, apply_masks, cubic_sparsity, magnitude_masks, prunable,
                                     sparse_speed, sparsity_report)
from lmkit.config import ModelConfig, get_preset
from lmkit.data.tokenize import vocab_size_of
from lmkit.errors import ConfigError
from lmkit.models import build_model

TEXT = "\n\n".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}  # line {i}" for i in range(150))


def _model(seed=0):
    torch.manual_seed(seed)
    return build_model(get_preset("tiny", vocab_size=97, d_model=24, n_heads=2, n_layers=2))


@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.77])
def test_global_masks_zero_exactly_the_smallest_weights(sparsity):
    model = _model()
    weights = prunable(model)
    assert weights and all(".layers." in n for n in weights)  # embeddings, norms, biases and head stay dense
    everything = torch.cat([w.detach().abs().flatten() for w in weights.values()])
    masks = magnitude_masks(model, sparsity, "global")
    kept = torch.cat([w.detach().abs().flatten()[m.flatten()] for w, m in zip(weights.values(), masks.values())])
    dropped = torch.cat([w.detach().abs().flatten()[~m.flatten()] for w, m in zip(weights.values(), masks.values())])
    assert dropped.numel() == round(sparsity * everything.numel())
    if dropped.numel():
        assert dropped.max() <= kept.min()  # no kept weight is smaller than a dropped one
    apply_masks(model, masks)
    assert sparsity_report(model)["sparsity"] == pytest.approx(dropped.numel() / everything.numel())


def test_layer_scope_prunes_each_matrix_to_the_same_fraction_and_global_does_not():
    model = _model()
    with torch.no_grad():  # make one layer's weights much larger: global pruning then spares it
        prunable(model)["decoder.layers.0.mlp.sublayer.up_proj.weight"].mul_(50)
    per_layer = magnitude_masks(model, 0.5, "layer")
    assert all(abs((~m).float().mean().item() - 0.5) < 0.01 for m in per_layer.values())
    global_ = magnitude_masks(model, 0.5, "global")
    assert (~global_["decoder.layers.0.mlp.sublayer.up_proj.weight"]).float().mean() < 0.01


def test_cubic_schedule_is_zhu_and_gupta():
    assert cubic_sparsity(0, 0.8, 0, 100) == 0.0 and cubic_sparsity(100, 0.8, 0, 100) == 0.8
    assert cubic_sparsity(50, 0.8, 0, 100) == pytest.approx(0.8 - 0.8 * 0.5 ** 3)
    values = [cubic_sparsity(t, 0.9, 10, 60) for t in range(0, 80)]
    assert values == sorted(values)  # never decreases
    steps = [values[t + 1] - values[t] for t in range(10, 59)]
    assert steps == sorted(steps, reverse=True)  # prunes fast early, slowly near the end


def test_gradual_pruning_reaches_its_sparsity_and_keeps_zeros_while_training():
    from lmkit.finetune.clm import train_causal_lm

    class Stream:
        def rows(self, seed, step, batch):
            g = torch.Generator().manual_seed(seed * 1000 + step)
            return torch.randint(1, 97, (batch, 17), generator=g)

    model = _model()
    pruning = GradualPruning(0.6, 0, 9, 3)
    seen = []
    original = pruning.after_step

    def after(m):
        original(m)
        seen.append(sparsity_report(m)["sparsity"])
    pruning.after_step = after
    train_causal_lm(model, Stream(), 0, 12, 4, lr=1e-2, warmup_steps=0, pruning=pruning)
    assert seen == sorted(seen) and seen[0] == 0.0  # the schedule starts dense and only rises
    assert seen[-1] == pytest.approx(0.6, abs=1e-3) and seen[9] == pytest.approx(0.6, abs=1e-3)
    zero_after_end = [w.detach() == 0 for w in prunable(model).values()]
    assert sum(int(z.sum()) for z in zero_after_end) > 0


def test_bad_sparsity_is_refused():
    for bad in (1.0, -0.1, "0.5", True):
        with pytest.raises(ConfigError, match="fraction"):
            magnitude_masks(_model(), bad)
    with pytest.raises(ConfigError, match="scope"):
        magnitude_masks(_model(), 0.5, "row")


def test_sparse_speed_times_two_forms_of_the_same_product():
    torch.manual_seed(0)
    w = torch.randn(256, 128)
    w[torch.rand_like(w) < 0.9] = 0
    t = sparse_speed(w, batch=8, repeats=2)
    assert t["max_difference"] < 1e-4  # CSR and dense compute the same x W^T (float32 sums in another order)
    assert set(t) == {"dense", "sparse_csr", "max_difference"}


def test_prune_unstructured_cli_saves_what_transformers_loads(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "corpus.txt").write_text(TEXT, encoding="utf-8")
    tok = lmkit.train_tokenizer([TEXT], kind="bpe", vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"])
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=vocab_size_of(tok), d_model=32, n_layers=2, n_heads=4, max_seq_len=32,
                                    family="gpt2"))
    model.save_pretrained(tmp_path / "model")
    tok.save(str(tmp_path / "model" / "tokenizer.json"))
    for steps in ("0", "4"):
        out = tmp_path / f"sparse{steps}"
        assert main(["prune", "--model", str(tmp_path / "model"), "--out", str(out), "--unstructured", "0.5",
                     "--gradual-steps", steps, "--corpus", str(tmp_path / "corpus.txt")]) == 0
        report = json.loads((out / "prune.json").read_text())
        assert report["sparsity"] == pytest.approx(0.5, abs=1e-3)
        ours = lmkit.load_model(out)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        ids = torch.tensor([tok.encode("def function_3(x):")])
        with torch.no_grad():
            assert torch.allclose(ours(ids).logits, theirs(ids).logits, atol=1e-5)
        assert "sparsity 50.0%" in capsys.readouterr().out
    assert main(["prune", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "x"), "--unstructured",
                 "1.5"]) == 2
    assert "[0, 1)" in capsys.readouterr().err
