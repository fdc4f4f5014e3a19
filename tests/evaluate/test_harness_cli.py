"""`lmkit harness` end to end: the table and lm-eval's results JSON, a user's own task folder, one-line refusals
of bad input, and the rolling-perplexity task's bits per byte against `lmkit eval`'s on the same documents."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from test_harness import _save, gpt2_folder  # noqa: E402
from helpers.hf_folders import build, cli  # noqa: E402
from helpers.processes import process_env  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    model, tok = gpt2_folder(None, n_positions=1024)
    return _save(model, tok, tmp_path_factory.mktemp("gpt2"))


def test_table_and_results_json(folder, capfd, tmp_path):
    out = tmp_path / "results.json"
    rc, stdout, _ = cli(capfd, "harness", "--model", folder, "--tasks", "pydoc_mc,addition_direct_d2,numbers",
                        "--limit", "2", "--num-fewshot", "1", "--gen-kwargs", "max_gen_toks=8", "--output", str(out))
    assert rc == 0
    assert "|pydoc_mc" in stdout and "acc_norm" in stdout and "strict-match" in stdout
    results = json.loads(out.read_text())
    assert set(results["results"]) == {"pydoc_mc", "addition_direct_d2", "numbers"}
    assert results["n-shot"] == {"pydoc_mc": 1, "addition_direct_d2": 1, "numbers": 1}  # --num-fewshot wins
    assert 0 <= results["results"]["pydoc_mc"]["acc,none"] <= 1


def test_a_users_own_task_folder_reads_local_jsonl(folder, capfd, tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"q": f"{i} plus one is", "a": f" {i + 1}"}) + "\n" for i in range(4)))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "plus_one.yaml").write_text(
        "task: plus_one\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: " + str(data) + "\n"
        "output_type: loglikelihood\ntest_split: test\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
        "metric_list:\n  - metric: acc\n")
    rc, stdout, _ = cli(capfd, "harness", "--model", folder, "--tasks", "plus_one", "--include-path", str(tasks))
    assert rc == 0 and "|plus_one" in stdout


def test_an_unknown_task_is_one_line(folder, capfd):
    rc, _, err = cli(capfd, "harness", "--model", folder, "--tasks", "pydoc_mcq")
    assert rc == 2 and "unknown task 'pydoc_mcq'" in err and "pydoc_mc" in err and len(err.strip().splitlines()) == 1


def test_a_task_file_that_does_not_parse_is_one_line(folder, capfd, tmp_path):
    (tmp_path / "broken.yaml").write_text("task: broken\ndoc_to_text: [unclosed\n")
    rc, _, err = cli(capfd, "harness", "--model", folder, "--tasks", "broken", "--include-path", str(tmp_path))
    assert rc == 2 and "broken.yaml does not parse" in err and len(err.strip().splitlines()) == 1


def test_an_encoder_only_folder_is_one_line(capfd, tmp_path):
    encoder = build("distilbert", tmp_path / "bert")
    rc, _, err = cli(capfd, "harness", "--model", encoder, "--tasks", "pydoc_mc")
    assert rc == 2 and "encoder-only" in err and len(err.strip().splitlines()) == 1


def test_without_lm_eval_the_command_says_what_to_install(folder, capfd, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now raises ImportError
    rc, _, err = cli(capfd, "harness", "--model", folder, "--tasks", "pydoc_mc")
    assert rc == 2 and "pip install 'lmkit[eval]'" in err


def test_import_lmkit_does_not_import_lm_eval():
    code = "import sys, lmkit, lmkit.evaluate, lmkit.cli; lmkit.cli.build_parser(); print('lm_eval' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_rolling_bits_per_byte_equal_lmkit_eval_when_documents_fit_the_context(folder):
    """Documents shorter than the context are one window each, read after the same BOS: the same nats, the same
    UTF-8 bytes, so the same bits per byte."""
    import lmkit
    from lmkit.data import Corpus, load_corpus
    from lmkit.evaluate import evaluate_text
    from lmkit.evaluate import harness_run
    from lmkit.evaluate.harness import LmkitLM

    docs = load_corpus("pydocs").split()[1].documents[:2]
    lm = LmkitLM(pretrained=folder, batch_size=4)
    assert all(len(lm.tok_encode(d.text)) < lm.max_length for d in docs)
    ours = harness_run.run("", ["pydocs_perplexity"], limit=2, lm=lm)["results"]["pydocs_perplexity"]
    ref = evaluate_text(lmkit.load_model(folder), lmkit.load_tokenizer(folder), Corpus("v", docs))
    assert ours["bits_per_byte,none"] == pytest.approx(ref["bpb"], rel=1e-5)


def test_generation_has_a_bar_over_its_requests_moved_once_per_batch(folder, monkeypatch):
    """generate_until draws a bar as the log-likelihoods do (stderr, on a terminal only): its total is the number
    of requests and it moves once per batch, across the groups of generation settings."""
    import io

    from lm_eval.api.instance import Instance
    from tqdm import tqdm

    import lmkit.evaluate.harness_generate as harness_generate
    from lmkit.evaluate.harness import LmkitLM

    opened = []

    def forced(enabled: bool = True, **kwargs):  # drawn as on a terminal, into a buffer
        bar = tqdm(file=io.StringIO(), disable=not enabled, **kwargs)
        moves = []
        update = bar.update
        bar.update = lambda n=1: moves.append(n) or update(n)
        opened.append((kwargs, bar, moves))
        return bar

    monkeypatch.setattr(harness_generate, "progress_bar", forced)
    settings = [{"until": ["\n"], "max_gen_toks": 4}] * 3 + [{"until": ["."], "max_gen_toks": 3}] * 2
    reqs = [Instance("generate_until", {}, (f"def f{i}(x):", s), i) for i, s in enumerate(settings)]
    out = LmkitLM(pretrained=folder, batch_size=2).generate_until(reqs)
    assert len(out) == 5 and all(isinstance(t, str) for t in out)
    (kwargs, bar, moves), = opened
    assert kwargs["desc"] == "generate_until" and bar.total == bar.n == len(reqs)
    assert moves == [2, 1, 2]  # batches of 2 within each group of settings (3 requests, then 2)
    assert "5/5" in bar.fp.getvalue()


# what `lmkit harness` writes to stderr outside a git checkout: no `fatal: not a git repository` (lm-eval asks git for
# the results' git_hash), and one line saying why the Stderr column is N/A; --bootstrap-iters fills that column
def harness(folder, cwd, *flags):
    return subprocess.run([sys.executable, "-m", "lmkit", "harness", "--model", folder, "--tasks", "pydoc_mc",
                           "--limit", "4", *flags], capture_output=True, text=True, cwd=cwd, env=process_env(),
                          timeout=600)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is what prints the message")
def test_no_git_noise_and_one_word_on_the_stderr_column(folder, tmp_path):
    outside = subprocess.run(["git", "rev-parse", "--git-dir"], cwd=tmp_path, capture_output=True)
    assert outside.returncode != 0, "the test needs a folder outside any git checkout"
    r = harness(folder, tmp_path, "--output", "results.json")
    assert r.returncode == 0, r.stderr
    assert "not a git repository" not in r.stderr
    assert r.stderr.count("Stderr is N/A") == 1 and "--bootstrap-iters" in r.stderr
    assert "|pydoc_mc" in r.stdout and "N/A" in r.stdout


def test_bootstrap_iters_fill_the_stderr_column(folder, tmp_path):
    r = harness(folder, tmp_path, "--bootstrap-iters", "20", "--output", "results.json")
    assert r.returncode == 0, r.stderr
    assert "Stderr is N/A" not in r.stderr
    results = json.loads((tmp_path / "results.json").read_text())["results"]["pydoc_mc"]
    assert isinstance(results["acc_stderr,none"], float)
