"""`torchrun --nproc-per-node 2 -m lmkit finetune --task sft` on the CPU (gloo) takes the step that one process takes
over the same global batch with gradient accumulation: the loss is the token-weighted mean over every micro-batch of
every rank."""
import itertools
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from helpers.processes import process_env
from test_sft import _sentence, folders  # noqa: F401  (the tiny GPT-2 folder saved by transformers)

import lmkit
from lmkit.finetune.sft import SFTConfig, collate, sft, token_losses
from lmkit.finetune.sft_data import prepare

# completions of 1 to about 60 tokens: each rank's share of the batch holds a very different number of them
LENGTHS = (1, 2, 40, 3)
FLAGS = ["--max-steps", "1", "--batch-size", "4", "--micro-batch-size", "1", "--lr", "1e-2", "--seed", "0",
         "--max-length", "96", "--precision", "fp32"]  # the reference below is computed in fp32


def _write(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def test_two_ranks_take_the_step_of_one_process_with_accumulation(folders, tmp_path):  # noqa: F811
    train = _write(tmp_path / "train.jsonl", [{"prompt": _sentence(i, 4) + "?", "completion": " " + _sentence(i + 2, n)}
                                              for i, n in enumerate(LENGTHS)])
    held = _write(tmp_path / "held.jsonl", [{"prompt": _sentence(i, 3), "completion": " " + _sentence(i, 1 + i)}
                                            for i in range(11)])  # two evaluation batches: one per rank
    model_dir = folders["gpt2"]
    one = sft(SFTConfig(model=str(model_dir), train=str(train), eval=str(held), out=str(tmp_path / "one"), max_steps=1,
                        batch_size=4, micro_batch_size=1, lr=1e-2, seed=0, max_length=96, precision="fp32"), log=None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "lmkit",
           "finetune", "--task", "sft", "--model", str(model_dir), "--train", str(train), "--eval", str(held),
           "--out", str(tmp_path / "two"), *FLAGS]
    r = subprocess.run(cmd, capture_output=True, text=True, env=process_env(), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("saved to") == 1  # rank 0 alone reports and writes
    two = json.loads((tmp_path / "two" / "sft.json").read_text())
    assert two["processes"] == 2 and one["processes"] == 1

    (a,), (b,) = ([json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                  for d in ("one", "two"))
    assert a["tokens"] == b["tokens"]  # the trained labels of the whole step, counted over both ranks
    assert abs(a["loss"] - b["loss"]) < 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-6 * a["grad_norm"]
    for key in ("eval_loss_before", "eval_loss_after"):
        assert abs(one[key] - two[key]) < 1e-6, key
    w1, w2 = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    w0 = load_file(model_dir / "model.safetensors")
    assert w1.keys() == w2.keys()
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-6
    assert max(float((w1[k] - w0[k]).abs().max()) for k in w1 if k in w0) > 1e-3  # the step moved the weights

    # the step's loss is sum(-log p) / all trained labels; a mean of per-rank means would be another number
    tok, base = lmkit.load_tokenizer(model_dir), lmkit.load_model(model_dir)
    examples, _ = prepare(tok, train, 96)
    with torch.no_grad():
        parts = [token_losses(base, collate([e], tok.pad_token_id)) for e in examples]
    sums, counts = [float(s) for s, _ in parts], [int(n) for _, n in parts]
    assert a["tokens"] == sum(counts) and max(counts) > 10 * min(counts)
    assert abs(a["loss"] - sum(sums) / sum(counts)) < 1e-6
    for share in itertools.combinations(range(4), 2):
        rest = [i for i in range(4) if i not in share]
        rank_means = [sum(sums[i] for i in s) / sum(counts[i] for i in s) for s in (share, rest)]
        assert abs(sum(rank_means) / 2 - a["loss"]) > 1e-3
