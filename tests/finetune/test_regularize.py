"""Forgetting remedies: L2-SP and EWC add exactly the gradient of their penalties, EWC's Fisher is the mean squared
per-sequence gradient, a strong pull keeps the weights (and the old corpus's loss) near the start, and
`lmkit finetune --task clm --regularize ... --forgetting-corpus ...` reports what fine-tuning cost elsewhere."""
import json

import pytest
import torch

import lmkit
from lmkit.cli import main
from lmkit.config import ModelConfig, get_preset
from lmkit.data.tokenize import vocab_size_of
from lmkit.errors import ConfigError
from lmkit.finetune.clm import sequence_loss, train_causal_lm
from lmkit.finetune.regularize import Anchor, build_anchor, fisher_diagonal, parse_regularize
from lmkit.models import build_model


def _model(seed=0):
    torch.manual_seed(seed)
    return build_model(get_preset("tiny", vocab_size=61, d_model=16, n_heads=2, n_layers=1)).train()


class Stream:
    """Rows counting through tokens 1..60 by `stride` from a random start: a rule a model learns, and two strides
    are two tasks that compete for the same weights."""

    def __init__(self, stride, seq_len=12):
        self.stride, self.seq_len = stride, seq_len

    def rows(self, seed, step, batch, *shard):
        g = torch.Generator().manual_seed(seed * 7919 + step)
        start = torch.randint(0, 60, (batch, 1), generator=g)
        return 1 + (start + self.stride * torch.arange(self.seq_len + 1)) % 60


@pytest.mark.parametrize("ewc", [False, True])
def test_added_gradient_is_the_penalty_gradient(ewc):
    model = _model()
    rows = Stream(1).rows(0, 0, 4)
    fisher = fisher_diagonal(model, rows, sequence_loss) if ewc else None
    anchor = Anchor(model, 0.3, fisher)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.zero_grad(set_to_none=True)
    anchor.add_gradients()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    penalty = sum(0.5 * 0.3 * ((fisher[n] if ewc else 1.0) * (p - anchor.start[n]) ** 2).sum()
                  for n, p in model.named_parameters())
    penalty.backward()
    for n, p in model.named_parameters():
        assert torch.allclose(ours[n], p.grad, atol=1e-7), n
    assert anchor.penalty() == pytest.approx(penalty.item(), rel=1e-5)


def test_fisher_is_the_mean_squared_per_sequence_gradient():
    model = _model()
    rows = Stream(1).rows(3, 0, 5)
    fisher = fisher_diagonal(model, rows, sequence_loss)
    assert model.training  # the estimate leaves the model as it found it
    name, param = next((n, p) for n, p in model.named_parameters() if n.endswith("q_proj.weight"))
    manual = torch.zeros_like(param)
    for row in rows:
        grad, = torch.autograd.grad(sequence_loss(model.eval(), row[None]), [param])
        manual += grad ** 2
    assert torch.allclose(fisher[name], manual / 5, rtol=1e-5, atol=1e-10)


@pytest.mark.parametrize("spec", ["l2sp:50", "ewc:20000"])
def test_a_strong_pull_keeps_the_weights_and_the_old_loss(spec):
    old, new = Stream(1), Stream(7)
    base = _model()
    train_causal_lm(base, old, 0, 30, 8, lr=3e-2, warmup_steps=0)  # a model that has learnt the old task

    def run(regularize):
        model = _model()
        model.load_state_dict(base.state_dict())
        model.train()
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        anchor = build_anchor(model, regularize, old.rows(0, 0, 8), sequence_loss)
        train_causal_lm(model, new, 0, 15, 8, lr=3e-2, warmup_steps=0, grad_clip=0.0, anchor=anchor)
        moved = sum(float((p.detach() - start[n]).pow(2).sum()) for n, p in model.named_parameters()) ** 0.5
        with torch.no_grad():
            loss = sequence_loss(model.eval(), old.rows(9, 0, 16)).item()
        return moved, loss
    (free_moved, free_loss), (held_moved, held_loss) = run(None), run(spec)
    if spec.startswith("l2sp"):  # EWC leaves weights the old task does not use (F = 0) free to move
        assert held_moved < 0.5 * free_moved
    assert held_loss < free_loss - 0.1, (held_loss, free_loss)


def test_bad_specs_are_refused():
    assert parse_regularize(None) is None and parse_regularize("l2sp:0.01") == ("l2sp", 0.01)
    for bad in ("l2:0.1", "ewc", "ewc:-1", "l2sp:inf", "l2sp:x"):
        with pytest.raises(ConfigError, match="l2sp:LAMBDA"):
            parse_regularize(bad)


def test_finetune_clm_cli_reports_forgetting(tmp_path, capsys):
    old = [f"the quick brown fox number {i} jumps over the lazy dog" for i in range(120)]
    new = [f"def f_{i}(x):\n    return x * {i}" for i in range(120)]
    for name, docs in (("old", old), ("new", new)):  # one document a line
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    old, new = "\n\n".join(old), "\n\n".join(new)
    tok = lmkit.train_tokenizer([old, new], kind="bpe", vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"])
    torch.manual_seed(0)
    build_model(ModelConfig(vocab_size=vocab_size_of(tok), d_model=16, n_layers=1, n_heads=2, max_seq_len=32,
                            family="gpt2")).save_pretrained(tmp_path / "base")
    tok.save(str(tmp_path / "base" / "tokenizer.json"))
    args = ["finetune", "--task", "clm", "--model", str(tmp_path / "base"), "--train", str(tmp_path / "new.jsonl"),
            "--peft", "full", "--max-steps", "3", "--batch-size", "4", "--max-length", "16",
            "--forgetting-corpus", str(tmp_path / "old.jsonl")]
    assert main(args + ["--out", str(tmp_path / "ewc"), "--regularize", "ewc:10"]) == 0
    report = json.loads((tmp_path / "ewc" / "finetune.json").read_text())
    assert report["regularize"] == "ewc:10" and report["forgetting"]["corpus"] == str(tmp_path / "old.jsonl")
    assert "forgetting on" in capsys.readouterr().out
    assert main(args + ["--out", str(tmp_path / "bad"), "--regularize", "ewc:0"]) == 2
    assert "l2sp:LAMBDA" in capsys.readouterr().err
    assert main(["finetune", "--model", str(tmp_path / "base"), "--train", str(tmp_path / "new.jsonl"), "--out",
                 str(tmp_path / "c"), "--regularize", "l2sp:1"]) == 2
    assert "--task clm only" in capsys.readouterr().err
