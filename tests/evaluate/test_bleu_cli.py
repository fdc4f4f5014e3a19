"""`lmkit eval` on a text-to-text model: BLEU and ROUGE of its outputs, from --pairs or a built-in --task."""
from __future__ import annotations

import json

import pytest
import torch

import lmkit
from lmkit.cli import main
from lmkit.config import get_preset
from lmkit.data.translation import make_pairs, task_tokenizer
from lmkit.evaluate.bleu import corpus_bleu
from lmkit.evaluate.rouge import corpus_rouge
from lmkit.evaluate.seq2seq import translate
from lmkit.models import build_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("numbers")
    tok = task_tokenizer()
    torch.manual_seed(0)
    model = build_model(get_preset("t5-tiny", vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_decoder_layers=1,
                                   n_heads=2, head_dim=16, d_ff=64, output_scale=32 ** -0.5))
    model.save_pretrained(folder)
    tok.save(folder / "tokenizer.json")
    return folder


def _value(out: str, label: str) -> list[float]:
    line = next(l for l in out.splitlines() if l.startswith(label))
    return [float(x) for x in line[len(label):].split("(")[0].replace("/", " ").split()]


def test_eval_pairs_prints_bleu_and_rouge(model_dir, tmp_path, capsys):
    pairs = make_pairs(100, 12, seed=3)[1]
    (tmp_path / "pairs.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in pairs), encoding="utf-8")
    assert main(["eval", "--model", str(model_dir), "--pairs", str(tmp_path / "pairs.tsv")]) == 0
    out = capsys.readouterr().out
    model, tok = lmkit.load_model(model_dir), lmkit.load_tokenizer(model_dir)
    hyps = translate(model, tok, [s for s, _ in pairs])
    refs = [t for _, t in pairs]
    assert _value(out, "BLEU")[0] == pytest.approx(corpus_bleu(hyps, refs).score, abs=0.006)
    rouge = corpus_rouge(hyps, refs)
    assert _value(out, "ROUGE-1/2/L") == pytest.approx([rouge["rouge1"], rouge["rouge2"], rouge["rougeL"]], abs=1e-4)
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"source": s, "target": t}) + "\n" for s, t in pairs))
    assert main(["eval", "--model", str(model_dir), "--pairs", str(tmp_path / "pairs.jsonl")]) == 0
    assert _value(capsys.readouterr().out, "BLEU") == _value(out, "BLEU")


def test_eval_errors_are_one_line(model_dir, tmp_path, capsys):
    assert main(["eval", "--model", str(model_dir)]) == 2  # no pairs, no task.json
    assert "--pairs FILE" in capsys.readouterr().err
    (tmp_path / "bad.tsv").write_text("no tab here\n")
    assert main(["eval", "--model", str(model_dir), "--pairs", str(tmp_path / "bad.tsv")]) == 2
    assert "exactly one tab" in capsys.readouterr().err


@pytest.mark.parametrize("row", [{"source": 1, "target": "x"}, {"source": "x", "target": None},
                                 {"source": ["a"], "target": "b"}])
def test_eval_jsonl_with_non_string_fields_is_one_line(model_dir, tmp_path, capsys, row):
    (tmp_path / "bad.jsonl").write_text(json.dumps(row) + "\n")
    assert main(["eval", "--model", str(model_dir), "--pairs", str(tmp_path / "bad.jsonl")]) == 2
    out = capsys.readouterr()
    assert "must be strings" in out.err and "Traceback" not in out.err and out.out == ""


def test_eval_bad_num_beams_is_refused_before_scoring(model_dir, tmp_path, capsys):
    (tmp_path / "ok.tsv").write_text("translate numbers to words: 12\ttwelve\n")
    assert main(["eval", "--model", str(model_dir), "--pairs", str(tmp_path / "ok.tsv"), "--num-beams", "0"]) == 2
    out = capsys.readouterr()
    assert "--num-beams" in out.err and out.out == ""


def test_eval_corpus_is_not_silently_ignored_for_text_to_text_models(model_dir, tmp_path, capsys):
    (tmp_path / "ok.tsv").write_text("translate numbers to words: 12\ttwelve\n")
    (tmp_path / "text.txt").write_text("Some text to score.\n")
    for extra in (["--task", "numbers"], ["--pairs", str(tmp_path / "ok.tsv")]):
        assert main(["eval", "--model", str(model_dir), "--corpus", str(tmp_path / "text.txt"), *extra]) == 2
        out = capsys.readouterr()
        assert "drop --corpus" in out.err and out.out == ""
