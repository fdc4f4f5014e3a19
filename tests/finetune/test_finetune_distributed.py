"""`torchrun --nproc-per-node 2` on the CPU (gloo) runs every fine-tuning job through the one loop: each rank takes its
share of the step's batch, the loss is the count-weighted mean over both, and the run equals one process within 1e-6
(LoRA on a causal LM, classification, distillation; SFT has its own test in test_sft_distributed.py)."""
import json
import shutil
import subprocess
import sys

import pytest
from helpers.processes import process_env
from safetensors.torch import load_file
from test_finetune_resume import commands  # noqa: F401
from test_finetune import task  # noqa: F401
from test_sft import folders  # noqa: F401

SHORT = {"lora": ["--max-steps", "3", "--batch-size", "4"], "distill": ["--max-steps", "3", "--batch-size", "4"],
         "classify": ["--epochs", "1", "--batch-size", "8"]}


@pytest.fixture(scope="module")
def steady(commands, task, tmp_path_factory):  # noqa: F811
    """The commands, the classifier's base without dropout: each rank would draw its own dropout masks."""
    base = tmp_path_factory.mktemp("steady") / "base"
    shutil.copytree(task / "base", base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "hidden_dropout_prob": 0.0,
                                                  "attention_probs_dropout_prob": 0.0}))
    classify = list(commands["classify"])
    classify[classify.index("--model") + 1] = str(base)
    return {**commands, "classify": classify}


def _run(argv, out, ranks):
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    cmd = [sys.executable, *launcher, "-m", "lmkit", *argv, "--out", str(out), "--precision", "fp32", "--seed", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=process_env(), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("job", ["lora", "classify", "distill"])
def test_two_ranks_take_the_steps_of_one_process(steady, tmp_path, job):
    argv = steady[job]
    for flag, value in zip(SHORT[job][::2], SHORT[job][1::2]):
        argv = argv[:argv.index(flag) + 1] + [value] + argv[argv.index(flag) + 2:] if flag in argv else argv + [flag, value]
    one, two = _run(argv, tmp_path / "one", 1), _run(argv, tmp_path / "two", 2)
    assert [r["step"] for r in one] == [r["step"] for r in two] and one
    for a, b in zip(one, two):
        # relative: distillation's loss (about 12 nats) is a float32 sum, whose last bit is about 1e-6
        assert abs(a["loss"] - b["loss"]) < 1e-6 * max(1.0, abs(a["loss"])) and a["tokens" if "tokens" in a else "step"] == b.get("tokens", b["step"])
    weights = sorted(p.name for p in (tmp_path / "one").glob("*.safetensors"))
    assert weights == sorted(p.name for p in (tmp_path / "two").glob("*.safetensors")) and weights
    for name in weights:
        w1, w2 = load_file(tmp_path / "one" / name), load_file(tmp_path / "two" / name)
        assert w1.keys() == w2.keys()
        # Adam divides by sqrt(v) + 1e-8: a gradient near 1e-8 turns summation-order noise into ~1e-7 per step
        assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-5
