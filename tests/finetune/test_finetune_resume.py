"""Every fine-tuning job runs through the one training loop, so each resumes as pre-training does: a real process
killed with SIGKILL after a checkpoint, then `--resume`d, logs the losses of the uninterrupted run and ends on its
weights, bit for bit (fp32 on the CPU). SFT, LoRA on a causal LM, classification, distillation and DPO."""
import json
import random
import subprocess
import sys

import pytest
from helpers.processes import kill_after_a_save, process_env, saved_steps
from test_finetune import task  # noqa: F401  (a tiny random BERT and fruit-vs-tool sentences)
from test_sft import _rows, folders  # noqa: F401  (tiny GPT-2 / LLaMA folders saved by transformers)

from lmkit.cli import main

RUN = ["--precision", "fp32", "--save-every", "3", "--seed", "0"]


@pytest.fixture(scope="module")
def commands(folders, task, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("resume")
    sft_rows = root / "sft.jsonl"
    sft_rows.write_text("".join(json.dumps(r) + "\n" for r in _rows("prompt_completion", 16)), encoding="utf-8")
    text = root / "docs.jsonl"
    text.write_text("".join(json.dumps({"text": r["prompt"] + r["completion"]}) + "\n"
                            for r in _rows("prompt_completion", 60)), encoding="utf-8")
    pairs = root / "pairs.jsonl"
    rows = _rows("prompt_completion", 16)
    pairs.write_text("".join(json.dumps({"prompt": r["prompt"], "chosen": r["completion"],
                                         "rejected": rows[(i + 5) % len(rows)]["completion"] + " no"}) + "\n"
                             for i, r in enumerate(rows)), encoding="utf-8")
    gpt2 = str(folders["gpt2"])
    return {
        "sft": ["finetune", "--task", "sft", "--model", gpt2, "--train", str(sft_rows), "--max-steps", "30",
                "--batch-size", "2", "--max-length", "48", "--lr", "1e-3"],
        "lora": ["finetune", "--task", "clm", "--peft", "lora", "--model", gpt2, "--train", str(text),
                 "--max-steps", "30", "--batch-size", "2", "--max-length", "16"],
        "classify": ["finetune", "--model", str(task / "base"), "--train", str(task / "train.jsonl"), "--eval",
                     str(task / "test.jsonl"), "--epochs", "2", "--batch-size", "8", "--lr", "2e-3"],
        "dpo": ["finetune", "--task", "dpo", "--model", gpt2, "--train", str(pairs), "--max-steps", "30",
                "--batch-size", "2", "--max-length", "48", "--lr", "1e-3"],
        "distill": ["distill", "--teacher", gpt2, "--corpus", str(text), "--max-steps", "30", "--batch-size", "2",
                    "--seq-len", "16"],
    }


def _cli(argv, out):
    return [sys.executable, "-m", "lmkit", *argv, "--out", str(out), *RUN]


def _rows_of(out):
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def _weights(out):
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


@pytest.mark.slow
@pytest.mark.parametrize("job", ["sft", "lora", "classify", "distill", "dpo"])
def test_a_sigkilled_fine_tuning_run_resumes_with_the_uninterrupted_losses(commands, tmp_path, job):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    r = subprocess.run(_cli(commands[job], straight), capture_output=True, text=True, env=process_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    kill_after_a_save(_cli(commands[job], killed), killed, 3, random.Random(0))
    if job != "classify":  # (kill_after_a_save checks the run had not ended; classification writes its best epoch)
        assert not (killed / "model.safetensors").exists() and not (killed / "adapter_model.safetensors").exists()
    r = subprocess.run(_cli(commands[job], killed) + ["--resume"], capture_output=True, text=True, env=process_env(),
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert saved_steps(killed)[-1] == saved_steps(straight)[-1]
    assert _rows_of(killed) == _rows_of(straight)  # every logged step's loss, bit for bit
    assert _weights(killed) == _weights(straight) and _weights(straight)


def test_resume_without_a_checkpoint_and_a_new_run_over_one_are_refused(commands, tmp_path, capsys):
    out = tmp_path / "run"
    capsys.readouterr()
    assert main([*commands["lora"], "--out", str(out), "--resume"]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err and not out.exists()
    assert main([*commands["lora"][:-6], "--max-steps", "3", "--batch-size", "2", "--max-length", "16", "--out",
                 str(out), "--save-every", "3", "--precision", "fp32"]) == 0
    assert main([*commands["lora"], "--out", str(out)]) == 2
    assert "--resume" in capsys.readouterr().err
