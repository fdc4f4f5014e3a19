"""`lmkit distill`, `lmkit prune` and `lmkit quantize` on a tiny model folder and a small text file."""
import json

import pytest
import torch

import lmkit
from lmkit.cli import main
from lmkit.config import ModelConfig
from lmkit.data.tokenize import vocab_size_of
from lmkit.models import build_model

TEXT = "\n\n".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}  # line {i}" for i in range(150))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    corpus = root / "corpus.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    tok = lmkit.train_tokenizer([TEXT], kind="bpe", vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"])
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab_size_of(tok), d_model=32,
                      n_layers=4, n_heads=4, max_seq_len=32, family="gpt2")
    model = build_model(cfg)
    model.save_pretrained(root / "model")
    tok.save(str(root / "model" / "tokenizer.json"))
    return root



def test_distill_cli(folder, capsys):
    out = folder / "student"
    code = main(["distill", "--teacher", str(folder / "model"), "--out", str(out), "--corpus", str(folder / "corpus.txt"),
                 "--max-steps", "3", "--batch-size", "2", "--seq-len", "16"])
    assert code == 0
    student = lmkit.load_model(out)
    assert student.config.n_layers == 2 and (out / "tokenizer.json").exists()
    report = json.loads((out / "distill.json").read_text())
    assert report["teacher"]["layers"] == 4 and report["student"]["layers"] == 2
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    assert "student keeps" in capsys.readouterr().out


def test_distill_cli_with_a_teacher_that_predicts_nothing_right(folder, tmp_path, capsys):
    """A teacher whose final norm is zero gives equal logits, so argmax picks id 0 (<|endoftext|>, never a target):
    accuracy 0, and the report says so instead of dividing by it (it printed 2997002997.0%)."""
    teacher = lmkit.load_model(folder / "model")
    final_norm = teacher.get_submodule("decoder.norm")
    torch.nn.init.zeros_(final_norm.weight)
    torch.nn.init.zeros_(final_norm.bias)
    teacher.save_pretrained(tmp_path / "teacher")
    (tmp_path / "teacher" / "tokenizer.json").write_bytes((folder / "model" / "tokenizer.json").read_bytes())
    assert main(["distill", "--teacher", str(tmp_path / "teacher"), "--out", str(tmp_path / "s"), "--corpus",
                 str(folder / "corpus.txt"), "--max-steps", "1", "--batch-size", "2", "--seq-len", "16"]) == 0
    assert json.loads((tmp_path / "s" / "distill.json").read_text())["teacher"]["accuracy"] == 0
    out = capsys.readouterr().out
    assert "the teacher predicts no next token right" in out and "%" not in out.splitlines()[-1]


def test_prune_cli(folder, capsys):
    out = folder / "pruned"
    assert main(["prune", "--model", str(folder / "model"), "--out", str(out), "--heads", "5",
                 "--corpus", str(folder / "corpus.txt"), "--batches", "2"]) == 0
    model = lmkit.load_model(out)
    heads = [layer.self_attn.sublayer.n_heads for layer in model.decoder.layers]
    assert sum(heads) == 16 - 5 and min(heads) >= 1
    assert "pruned 5 heads" in capsys.readouterr().out


def test_quantize_cli(folder, capsys):
    out = folder / "int8"
    assert main(["quantize", "--model", str(folder / "model"), "--corpus", str(folder / "corpus.txt"),
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| int8 |" in text and "size x" in text and "written to" in text
    report = json.loads((out / "quantize.json").read_text())
    back = lmkit.load_model(out)
    assert hasattr(back.decoder.layers[0].mlp.sublayer.up_proj, "_packed_params") and (out / "tokenizer.json").exists()
    from lmkit.compress import weight_bytes

    assert weight_bytes(back) == report["int8"]["bytes"]


def test_missing_tokenizer_is_a_user_error(folder, tmp_path, capsys):
    model = lmkit.load_model(folder / "model")
    model.save_pretrained(tmp_path / "bare")
    assert main(["prune", "--model", str(tmp_path / "bare"), "--out", str(tmp_path / "o"), "--heads", "1"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err


def test_bad_settings_are_user_errors(folder, tmp_path, capsys):
    assert main(["distill", "--teacher", str(folder / "model"), "--out", str(tmp_path / "s"), "--temperature", "0"]) == 2
    assert "temperature must be a number > 0" in capsys.readouterr().err
    assert main(["prune", "--model", str(folder / "model"), "--out", str(tmp_path / "p"), "--heads", "13",
                 "--corpus", str(folder / "corpus.txt"), "--batches", "1"]) == 2
    assert "cannot prune exactly 13 heads" in capsys.readouterr().err


def test_an_encoder_folder_is_refused_by_name(tmp_path, capsys):
    """A BERT-style folder (what a new user may have at hand) gets one line naming it and its family."""
    tok = lmkit.train_tokenizer([TEXT], kind="wordpiece", vocab_size=200)
    encoder = build_model(lmkit.get_preset("bert", vocab_size=vocab_size_of(tok), d_model=32, n_layers=1, n_heads=2,
                                           d_ff=64, max_seq_len=32))
    encoder.save_pretrained(tmp_path / "bert")
    tok.save(str(tmp_path / "bert" / "tokenizer.json"))
    for args in (["quantize", "--model"], ["finetune", "--task", "clm", "--train", "pydocs", "--out", str(tmp_path / "f"),
                                           "--model"]):
        assert main([*args, str(tmp_path / "bert")]) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / 'bert'} holds an encoder model" in err and "causal language models" in err, err
        assert err.count("\n") == 1
    # an encoder's heads are pruned by a classifier's loss, so pruning one asks for its labelled rows
    assert main(["prune", "--heads", "1", "--out", str(tmp_path / "p"), "--model", str(tmp_path / "bert")]) == 2
    err = capsys.readouterr().err
    assert "pass --data FILE" in err and err.count("\n") == 1
