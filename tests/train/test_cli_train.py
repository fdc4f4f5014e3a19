"""`lmkit train` / `lmkit eval` end to end through `python -m lmkit`, and their one-line errors."""
import json
import subprocess
import sys

import pytest


def lmkit(*args, cwd):
    return subprocess.run([sys.executable, "-m", "lmkit", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_train_resume_and_eval(corpus_file, tmp_path):
    flags = ["--preset", "tiny", "--corpus", corpus_file, "--out", "run", "--batch-size", "4", "--seq-len", "32",
             "--precision", "fp32", "--save-every", "2", "--log-every", "1"]
    r = lmkit("train", *flags, "--max-steps", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "bits per byte" in r.stdout
    r = lmkit("train", *flags, "--max-steps", "4", "--resume", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "resuming at step 2" in r.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and "val_bpb" in rows[-1]
    r = lmkit("eval", "--model", "run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    bpb = float(next(line for line in r.stdout.splitlines() if line.startswith("bits per byte")).split()[-1])
    assert bpb == pytest.approx(rows[-1]["val_bpb"], rel=1e-4)
    r = lmkit("eval", "--model", "run", "--stride", "8", cwd=tmp_path)  # overlapping windows: same tokens, more context
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == lmkit("eval", "--model", "run", cwd=tmp_path).stdout.splitlines()[0]
    assert lmkit("eval", "--model", "run", "--stride", "32", cwd=tmp_path).returncode == 2  # not below the context


@pytest.mark.parametrize("args, message", [
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--corpus", "missing.txt"], "neither a built-in corpus"),
    (["--corpus", "empty.txt"], "is empty"),
    (["--resume"], "holds no checkpoint"),
    (["--objective", "mlm"], "--objective mlm"),  # "not available yet", or not for the default (decoder) preset
    (["--lr", "inf"], "--lr must be a positive number"),
    (["--time-budget", "inf"], "--time-budget must be a positive number"),
    (["--max-steps", "0"], "--max-steps must be"),
    (["--warmup-steps", "-1"], "--warmup-steps must be >= 0, got -1"),
    (["--out", "empty.txt/run"], "is a file, not a folder"),
    # the run's own files would be read as training text by the next run on the same --corpus
    (["--corpus", "texts", "--out", "texts"], "--out texts is inside the corpus folder texts: the run's files would "
     "be read as training text next time; choose a --out outside it, or in a hidden folder"),
    (["--corpus", "texts/", "--out", "texts/runs/a"], "--out texts/runs/a is inside the corpus folder texts/"),
    (["--corpus", "texts/**/*.jsonl", "--out", "texts/run"], "the run's metrics.jsonl would match --corpus"),
    (["--corpus", "old/metrics.jsonl", "--out", "old"], "old/metrics.jsonl is one of the corpus files"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, args, message):
    (tmp_path / "empty.txt").write_text("\n\n")
    for name in ("texts/a.jsonl", "old/metrics.jsonl"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(9)))
    r = lmkit("train", "--out", "out", "--max-steps", "1", *args, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.startswith("lmkit: error: ") and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_out_beside_what_the_corpus_reads_is_allowed(tmp_path, monkeypatch):
    """A glob that matches none of the run's files, a file next to --out, a hidden folder a corpus folder skips."""
    from lmkit.data.corpus import refuse_output_folder
    from lmkit.train.setup import RUN_FILES

    monkeypatch.chdir(tmp_path)
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("some text")
    for corpus, out in ((["texts/*.txt"], "texts/run"), (["texts/a.txt"], "texts"), (["texts"], "texts/.runs/a"),
                        (["texts", "pydocs"], "runs/a")):
        refuse_output_folder(corpus, "--out", out, RUN_FILES)


def test_nan_loss_is_one_clear_last_line_and_leaves_nothing(corpus_file, tmp_path):
    r = lmkit("train", "--preset", "tiny", "--corpus", corpus_file, "--out", "out", "--max-steps", "4", "--batch-size", "4",
              "--seq-len", "32", "--precision", "fp32", "--lr", "1e30", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]  # after the progress bar, which is closed first
    assert last.startswith("lmkit: error: ") and "became nan" in last and "lower --lr" in last, r.stderr
    assert r.stderr.count("lmkit: error") == 1
    assert not (tmp_path / "out").exists()


def test_eval_elsewhere_names_the_training_corpus_it_cannot_read(corpus_file, tmp_path, monkeypatch, capsys):
    from lmkit.cli import main

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "small.jsonl").write_text(open(corpus_file, encoding="utf-8").read(), encoding="utf-8")
    monkeypatch.chdir(tmp_path / "a")
    assert main(["train", "--preset", "tiny", "--corpus", "small.jsonl", "--out", "run", "--max-steps", "1",
                 "--batch-size", "2", "--seq-len", "16", "--precision", "fp32"]) == 0
    monkeypatch.chdir(tmp_path / "b")
    capsys.readouterr()
    assert main(["eval", "--model", str(tmp_path / "a" / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lmkit: error: the corpus") and "pass --corpus" in err and "\n" not in err, err


def test_output_to_a_pipe_gets_plain_lines_not_a_progress_bar(corpus_file, tmp_path):
    """Redirected output (a log file, CI): no tqdm redraws; one line per evaluation instead."""
    r = lmkit("train", "--preset", "tiny", "--corpus", corpus_file, "--out", "run", "--max-steps", "4",
              "--batch-size", "2", "--seq-len", "16", "--precision", "fp32", "--save-every", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr and "step/s" not in r.stderr and "it/s" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["step 2/4", "step 4/4"], r.stderr
    assert all("val_bpb" in line for line in lines)


def test_eval_refuses_what_it_cannot_score_in_one_line(tmp_path, capsys):
    import lmkit
    from lmkit.cli import main
    from lmkit.config import get_preset
    from lmkit.models import build_model
    from lmkit.models.encoder import Encoder

    tok = lmkit.train_tokenizer(["some text to train on, " * 20], kind="bpe", vocab_size=300)
    for name, preset in (("gpt", "tiny"), ("bare-encoder", "bert")):
        cfg = get_preset(preset, vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=32)
        model = build_model(cfg) if preset == "tiny" else Encoder(cfg, head=None)
        model.save_pretrained(tmp_path / name)
        tok.save(str(tmp_path / name / "tokenizer.json"))
    capsys.readouterr()
    # a decoder given to the text-to-text scores (this was a traceback about batch sizes)
    assert main(["eval", "--model", str(tmp_path / "gpt"), "--task", "numbers"]) == 2
    err = capsys.readouterr().err
    assert "holds a decoder model" in err and "--corpus" in err and err.count("\n") == 1, err
    # an encoder without a language-model head (all-MiniLM-L6-v2, say)
    assert main(["eval", "--model", str(tmp_path / "bare-encoder")]) == 2
    err = capsys.readouterr().err
    assert "without a masked-LM head" in err and err.count("\n") == 1, err


def test_eval_on_the_training_files_spelled_otherwise_scores_their_validation_split(corpus_file, tmp_path,
                                                                                    monkeypatch, capsys):
    """Trained on `small.jsonl`, evaluated on its absolute path or a glob: the model was trained on it, so only
    its validation split is scored (document ids follow the spelling training used, so the split does too)."""
    from lmkit.cli import main

    (tmp_path / "small.jsonl").write_text(open(corpus_file, encoding="utf-8").read(), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--preset", "tiny", "--corpus", "small.jsonl", "--out", "run", "--max-steps", "1",
                 "--batch-size", "2", "--seq-len", "16", "--precision", "fp32"]) == 0
    capsys.readouterr()
    reports = []
    for spelling in ("small.jsonl", str(tmp_path / "small.jsonl"), "./sm*.jsonl"):
        assert main(["eval", "--model", "run", "--corpus", spelling]) == 0
        reports.append(capsys.readouterr().out.splitlines())
    assert "validation split" in reports[0][0]
    assert reports[1] == reports[2] == reports[0]
    (tmp_path / "other.jsonl").write_text(open(corpus_file, encoding="utf-8").read(), encoding="utf-8")
    assert main(["eval", "--model", "run", "--corpus", "other.jsonl"]) == 0  # a copy is other text: all of it
    assert "(all " in capsys.readouterr().out
