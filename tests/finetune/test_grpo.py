"""`lmkit finetune --task grpo`: rollouts through the Engine scored as they were sampled, seeded runs repeat,
rewards from built-ins and from user functions in a worker process, and a reward that fails stops the run with
its state saved, from which --resume gives the run it would have been."""
from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from lmkit.cli import main
from lmkit.errors import RewardError
from lmkit.finetune.grpo import GRPOConfig, GRPOJob
from lmkit.finetune.grpo_loss import completion_logps
from lmkit.finetune.rewards import checked, exact_answer
from lmkit.train import distributed
from serving_folders import make_folder

pytest.importorskip("transformers")
PROMPTS = ["hello world", "the quick brown", "def f(x):", "stop here", "naïve café", "The fox"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    return {family: make_folder(root / family, family, n_positions=64) for family in ("gpt2", "llama")}


def _prompts(path, rows=None):
    rows = rows or [{"prompt": p, "answer": str(i)} for i, p in enumerate(PROMPTS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _run(*args):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["finetune", "--task", "grpo", *map(str, args)])
    return code, err.getvalue()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_rollouts_are_scored_as_the_engine_sampled_them(folders, tmp_path, family):
    """The training forward over left-padded prompts gives each sampled token the log-probability the engine drew
    it with (so the ratio is 1 on-policy), and the same seed samples the same completions."""
    from lmkit.generation.engine import Request

    job = GRPOJob(GRPOConfig(model=str(folders[family]), prompts=str(_prompts(tmp_path / "p.jsonl")),
                             reward="regex:o", out=None, num_generations=3, batch_size=9, max_completion_length=7),
                  distributed.setup(None))
    seen = {}
    original = Request.__init__

    def with_logprobs(self, *args, **kwargs):  # every rollout request also records its tokens' log-probabilities
        original(self, *args, **{**kwargs, "logprobs": 0})
        seen.setdefault("requests", []).append(self)

    Request.__init__ = with_logprobs
    try:
        picks = job.prompts_of(0)
        first = job.rollouts(0, picks)
    finally:
        Request.__init__ = original
    assert first == job.rollouts(0, picks) and first != job.rollouts(1, picks)
    assert len({len(job.ids[i]) for i in picks}) > 1  # the batch left-pads some prompts
    batch = job.collate([job.ids[i] for i in picks for _ in range(3)], first)
    with torch.no_grad():
        logps, _ = completion_logps(job.model.eval(), batch["prompt_ids"], batch["prompt_mask"],
                                    batch["completion_ids"], batch["completion_mask"])
    for row, request in enumerate(seen["requests"]):
        n = len(request.output)
        torch.testing.assert_close(logps[row, :n], torch.tensor(request.token_logprobs), atol=1e-5, rtol=1e-5)
    job.close()


def test_a_seeded_run_repeats_and_writes_the_tuned_folder(folders, tmp_path):
    prompts = _prompts(tmp_path / "p.jsonl")
    rows = []
    for name in ("a", "b"):
        code, err = _run("--model", folders["llama"], "--prompts", prompts, "--reward", "regex:o", "--out",
                         tmp_path / name, "--num-generations", 4, "--batch-size", 8, "--max-steps", 2,
                         "--max-completion-length", 8, "--beta", 0.1, "--lr", 1e-3, "--precision", "fp32")
        assert code == 0, err
        rows.append([json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()])
    assert rows[0] == [{**r, "elapsed": a["elapsed"]} for r, a in zip(rows[1], rows[0])]
    assert [r["step"] for r in rows[0]] == [1, 2] and rows[0][1]["kl"] > 0  # step 2's policy moved from the reference
    assert {"reward", "reward_std", "kl", "entropy", "clip_ratio/region_mean"} <= set(rows[0][0])
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    report = json.loads((tmp_path / "a" / "grpo.json").read_text())
    assert report["steps"] == 2 and report["config"]["loss_type"] == "dapo"


def test_a_user_reward_that_raises_names_its_row_and_the_run_resumes(folders, tmp_path, monkeypatch):
    """The function runs in a worker process; when it raises, the run stops with one line naming the function and
    the row, its state saved; fixed, --resume ends where an uninterrupted run ends."""
    monkeypatch.chdir(tmp_path)
    prompts = _prompts(tmp_path / "p.jsonl")
    good = "import os\ndef score(prompts, completions, answer, **_):\n" \
           "    return [float(len(c) % 3) + (os.getpid() != PARENT) for c in completions]\n"
    (tmp_path / "rew.py").write_text(f"PARENT = {__import__('os').getpid()}\n" + good)
    args = ("--model", folders["llama"], "--prompts", prompts, "--reward", "rew:score", "--num-generations", 2,
            "--batch-size", 4, "--max-steps", 3, "--max-completion-length", 6, "--lr", 1e-3, "--precision", "fp32")
    assert _run(*args, "--out", tmp_path / "whole")[0] == 0
    metrics = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["reward"] >= 1 for r in metrics)  # out of process: every reward got the worker's +1

    (tmp_path / "rew.py").write_text(f"PARENT = {__import__('os').getpid()}\n" + good.replace(
        "    return", "    if any('fox' in p for p in prompts):\n        raise ValueError('no foxes')\n    return"))
    code, err = _run(*args, "--out", tmp_path / "cut")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "reward rew:score raised on row" in err and "ValueError: no foxes" in err and "--resume" in err
    assert (tmp_path / "cut" / "checkpoint").is_dir() and not (tmp_path / "cut" / "model.safetensors").exists()
    (tmp_path / "rew.py").write_text(f"PARENT = {__import__('os').getpid()}\n" + good)
    assert _run(*args, "--out", tmp_path / "cut", "--resume")[0] == 0
    assert (tmp_path / "cut" / "model.safetensors").read_bytes() == \
        (tmp_path / "whole" / "model.safetensors").read_bytes()


def test_rewards_of_the_wrong_length_or_not_finite_name_function_and_row():
    rows = ["completion 0 of prompt row 1", "completion 1 of prompt row 1"]
    assert checked("f", [1, None], 2, rows)[0] == 1.0
    with pytest.raises(RewardError, match="reward f returned 1 rewards for 2 completions"):
        checked("f", [1.0], 2, rows)
    with pytest.raises(RewardError, match=r"reward f returned nan for completion 1 of prompt row 1"):
        checked("f", [1.0, float("nan")], 2, rows)
    assert exact_answer(["q"] * 3, ["so The answer is 42.", "The answer is -4", "42"], ["42", "-4", "42"]) == [1, 1, 0]


@pytest.mark.parametrize("rows, reward, needle", [
    ([{"prompt": ""}], "regex:o", "p.jsonl:1: a row needs \"prompt\""),
    ([{"prompt": "a"}, {"text": "b"}], "regex:o", "p.jsonl:2: a row needs \"prompt\""),
    ([{"prompt": "a"}], "exact-answer", "has no such column"),
    ([{"prompt": "a"}], "regex:(", "not a regular expression"),
    ([{"prompt": "a"}], "nosuchmodule:f", "cannot load the function"),
    ([{"prompt": "hello world " * 30}], "regex:o", "more than --max-prompt-length 20"),
    ([{"prompt": "a"}], "regex:o --loss-type sigmoid", "--loss-type must be one of grpo, bnpo, dr_grpo, dapo"),
])
def test_bad_input_is_one_line_and_writes_nothing(folders, tmp_path, monkeypatch, rows, reward, needle):
    monkeypatch.chdir(tmp_path)
    code, err = _run("--model", folders["gpt2"], "--prompts", _prompts(tmp_path / "p.jsonl", rows), "--reward",
                     *reward.split(" "), "--out", tmp_path / "out", "--max-prompt-length", 20, "--num-generations", 2,
                     "--batch-size", 2)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_the_builtin_addition_task_runs_with_the_exact_answer_reward(folders, tmp_path):
    code, err = _run("--model", folders["gpt2"], "--prompts", "addition-cot", "--reward", "exact-answer", "--out",
                     tmp_path / "out", "--max-steps", 1, "--num-generations", 2, "--batch-size", 4,
                     "--max-completion-length", 5)
    assert code == 0, err
    row = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["reward"] == 0.0 and row["completions/mean_length"] <= 5  # a random model answers nothing right


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_reward_model_folder_scores_as_transformers_and_drives_a_run(folders, tmp_path, family):
    import shutil

    import transformers

    from lmkit.finetune.reward_model import RewardModel
    from lmkit.tokenizers import load_tokenizer

    cfg = transformers.AutoConfig.from_pretrained(folders[family])
    cfg.num_labels, cfg.pad_token_id = 1, cfg.eos_token_id
    torch.manual_seed(2)
    hf = transformers.AutoModelForSequenceClassification.from_config(cfg).eval()
    hf.save_pretrained(tmp_path / "rm")
    shutil.copy(folders[family] / "tokenizer.json", tmp_path / "rm" / "tokenizer.json")
    tok = load_tokenizer(tmp_path / "rm" / "tokenizer.json")
    prompts, completions = ["hello world", "naïve", "def f(x):"], [" the fox", " café 東京", "\n    return x"]
    with torch.no_grad():
        want = [hf(torch.tensor([tok.encode(p + c, add_special_tokens=False)])).logits[0, 0].item()
                for p, c in zip(prompts, completions)]
    assert RewardModel(str(tmp_path / "rm"))(prompts, completions) == pytest.approx(want, abs=1e-5)
    code, err = _run("--model", folders[family], "--prompts", _prompts(tmp_path / "p.jsonl"), "--reward",
                     tmp_path / "rm", "--out", tmp_path / "out", "--max-steps", 1, "--num-generations", 2,
                     "--batch-size", 4, "--max-completion-length", 4)
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])["reward_std"] > 0


def test_conversational_prompts_reach_the_reward_as_messages(folders, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "chat_reward.py").write_text(
        "def score(prompts, completions, topic, **_):\n"
        "    assert prompts[0][-1]['role'] == 'user' and topic[0] in ('fox', 'code')\n"
        "    return [float(c[-1]['role'] == 'assistant') + len(c[-1]['content']) % 2 for c in completions]\n")
    rows = [{"prompt": [{"role": "user", "content": "tell me about the fox"}], "topic": "fox"},
            {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"}],
             "topic": "code"}]
    code, err = _run("--model", folders["llama"], "--prompts", _prompts(tmp_path / "p.jsonl", rows), "--reward",
                     "chat_reward:score", "--out", tmp_path / "out", "--max-steps", 1, "--num-generations", 3,
                     "--batch-size", 6, "--max-completion-length", 5)
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])["reward"] >= 1
    assert lmkit_tokenizer(tmp_path / "out").chat_template == lmkit_tokenizer(folders["llama"]).chat_template


def lmkit_tokenizer(folder):
    from lmkit.tokenizers import load_tokenizer

    return load_tokenizer(folder)


def test_a_reward_function_in_a_file_elsewhere(folders, tmp_path, monkeypatch):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "my rewards.py").write_text("def one(prompts, completions, **_):\n"
                                                    "    return [1.0 + len(c) % 2 for c in completions]\n")
    monkeypatch.chdir(folders["gpt2"])
    code, err = _run("--model", folders["gpt2"], "--prompts", _prompts(tmp_path / "p.jsonl"), "--reward",
                     f"{tmp_path / 'lib' / 'my rewards.py'}:one", "--out", tmp_path / "out", "--max-steps", 1,
                     "--num-generations", 2, "--batch-size", 4, "--max-completion-length", 4)
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])["reward"] >= 1


def test_num_iterations_reuses_a_generation_and_resumes_within_it(folders, tmp_path):
    """mu = 2: steps 1 and 2 train on one generation (the ratio against the policy that sampled it); a run resumed
    after step 1 keeps that generation and ends with the weights of the run that was not stopped."""
    import shutil

    args = ("--model", folders["llama"], "--prompts", _prompts(tmp_path / "p.jsonl"), "--reward", "regex:o",
            "--num-generations", 4, "--batch-size", 8, "--max-steps", 3, "--num-iterations", 2,
            "--max-completion-length", 6, "--lr", 3e-2, "--beta", 0.1, "--precision", "fp32", "--save-every", 1)
    for name in ("whole", "cut"):
        assert _run(*args, "--out", tmp_path / name)[0] == 0
    rows = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    same = ("reward", "reward_std", "completions/mean_length")
    assert [rows[0][k] for k in same] == [rows[1][k] for k in same] and rows[0]["kl"] == 0 < rows[1]["kl"]
    assert rows[1]["entropy"] != rows[0]["entropy"]  # step 2 scores the generation with the updated weights
    assert rows[0]["clip_ratio/region_mean"] == 0 < rows[1]["clip_ratio/region_mean"]  # its ratio moved off 1
    cut = tmp_path / "cut"
    for step in (2, 3):
        shutil.rmtree(cut / "checkpoint" / f"step-{step:08d}")
    assert _run(*args, "--out", cut, "--resume")[0] == 0  # from step 1, inside generation 0
    assert (cut / "model.safetensors").read_bytes() == (tmp_path / "whole" / "model.safetensors").read_bytes()
