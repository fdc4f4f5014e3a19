"""Training on a CUDA device: `lmkit train --device cuda` takes the losses the CPU takes, resumes with the losses
it would have had, defaults to bf16 where the GPU has it, and runs DDP over NCCL; the fine-tuning and
compression jobs run there too."""
import json
import subprocess
import sys

import pytest
import torch

import lmkit
from lmkit.cli import main
from lmkit.train.precision import default_precision
from helpers.shards import small_shards
from helpers.processes import process_env

FLAGS = ["--preset", "tiny", "--batch-size", "8", "--seq-len", "32", "--save-every", "2", "--log-every", "1",
         "--warmup-steps", "10",  # runs of 2 and 4 steps share their schedule: still warming up
         "--seed", "3"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory, small_pydocs):
    return small_shards(tmp_path_factory.mktemp("gpu"), small_pydocs)


def train(out, data, *extra) -> dict[int, dict]:
    assert main(["train", "--data", str(data), "--out", str(out), *FLAGS, *extra]) == 0
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def whole(shards):
    return train(shards / "whole", shards / "data", "--max-steps", "4", "--precision", "fp32", "--device", "cuda")


def test_cuda_training_takes_the_cpu_losses(shards, whole):
    cpu = train(shards / "cpu", shards / "data", "--max-steps", "2", "--precision", "fp32", "--device", "cpu")
    assert abs(cpu[1]["loss"] - whole[1]["loss"]) < 1e-4  # the same weights, data and loss: float32 apart
    assert abs(cpu[2]["loss"] - whole[2]["loss"]) < 1e-3  # after one AdamW step, which divides by tiny moments
    model = lmkit.load_model(shards / "whole")  # what a GPU run saves loads anywhere
    assert model.device == torch.device("cpu")


def test_a_cuda_run_resumes_with_the_losses_it_would_have_had(shards, whole):
    out = shards / "cut"
    train(out, shards / "data", "--max-steps", "2", "--precision", "fp32", "--device", "cuda")
    resumed = train(out, shards / "data", "--max-steps", "4", "--resume", "--device", "cuda")
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):  # GPU kernels are not all bitwise repeatable: a hair apart, where a wrong resume is 1e-2
        assert abs(resumed[step]["loss"] - whole[step]["loss"]) < 1e-4, step


def test_bf16_is_the_default_where_the_gpu_has_it(shards, capsys):
    assert default_precision("cuda") == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")
    rows = train(shards / "default", shards / "data", "--max-steps", "2", "--device", "cuda")
    assert f", {default_precision('cuda')}" in capsys.readouterr().out
    assert all(r["loss"] == r["loss"] and r["loss"] < 10 for r in rows.values())  # finite, learning


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DDP over NCCL needs two GPUs")
def test_two_nccl_ranks_take_the_losses_of_one_process(shards, whole):
    out = shards / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "lmkit", "train",
           "--data", str(shards / "data"), "--out", str(out), *FLAGS, "--max-steps", "4", "--precision", "fp32",
           "--device", "cuda"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=process_env(), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "(DDP, nccl)" in r.stdout
    two = {row["step"]: row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    for step in range(1, 5):
        assert abs(two[step]["loss"] - whole[step]["loss"]) < (1e-4 if step == 1 else 1e-3), step


def test_fine_tuning_and_distillation_run_on_cuda(shards, whole, tmp_path):
    model = str(shards / "whole")
    assert main(["finetune", "--task", "clm", "--model", model, "--train", str(shards / "c.jsonl"), "--out",
                 str(tmp_path / "lora"), "--peft", "lora", "--max-steps", "2", "--batch-size", "4",
                 "--device", "cuda"]) == 0
    report = json.loads((tmp_path / "lora" / "finetune.json").read_text())
    assert report["after"]["loss"] == report["after"]["loss"]
    rows = [{"prompt": f"What is {i} + {i}?", "completion": f" {2 * i}."} for i in range(8)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["finetune", "--task", "sft", "--model", model, "--train", str(tmp_path / "sft.jsonl"), "--out",
                 str(tmp_path / "sft"), "--max-steps", "2", "--batch-size", "4", "--device", "cuda"]) == 0
    assert main(["distill", "--teacher", model, "--out", str(tmp_path / "student"), "--corpus",
                 str(shards / "c.jsonl"), "--max-steps", "2", "--batch-size", "4", "--device", "cuda"]) == 0
    assert main(["prune", "--model", model, "--out", str(tmp_path / "pruned"), "--heads", "1", "--corpus",
                 str(shards / "c.jsonl"), "--batches", "1", "--device", "cuda"]) == 0
    for folder in ("sft", "student", "pruned"):
        assert lmkit.load_model(tmp_path / folder).device == torch.device("cpu")
