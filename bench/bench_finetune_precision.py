"""fp32 vs bf16 autocast for SFT, LoRA (clm) and classification through the one training loop: same data, same
steps (docs/benchmarks.md). Usage: python bench/bench_finetune_precision.py OUT_DIR [THREADS]

What counts: the loop's own optimizer steps (TrainLoop.train_step: forward, backward, clipping, AdamW), the first
step of each run left out (one-time warm-up: oneDNN primitives, compiled kernels), evaluation and saving left out;
with one thread (the default) the clock is the process's CPU time, so that waiting for a core shared with other
jobs does not count. fp32 and bf16 runs alternate, twice, and the faster of each counts."""
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
import transformers

import lmkit
from lmkit.finetune.sft import SFTConfig, sft
from lmkit.finetune.clm import finetune_causal_lm_folder
from lmkit.finetune import FinetuneConfig, finetune
from lmkit.train.loop import TrainLoop

root = Path(sys.argv[1]); root.mkdir(parents=True, exist_ok=True)
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
CLOCK = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
STEP_TIMES: list[float] = []  # seconds of each TrainLoop.train_step of the current run
_train_step = TrainLoop.train_step


def timed_train_step(self, step):
    start = CLOCK()
    loss = _train_step(self, step)
    STEP_TIMES.append(CLOCK() - start)
    return loss


TrainLoop.train_step = timed_train_step
rng = random.Random(0)
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()
sent = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))
texts = [sent(rng.randint(100, 300)) for _ in range(400)]
tok = lmkit.train_tokenizer(texts, kind="bpe", vocab_size=400, special_tokens=["<|endoftext|>", "<|pad|>"])
V = tok.vocab_size
if not (root / "gpt2").exists():
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=768, n_layer=4, n_head=12, n_positions=512,
                                 bos_token_id=0, eos_token_id=0)).save_pretrained(root / "gpt2")
    tok.save(str(root / "gpt2" / "tokenizer.json"))
    wp = lmkit.train_tokenizer(texts, kind="wordpiece", vocab_size=400)
    transformers.BertModel(transformers.BertConfig(vocab_size=wp.vocab_size, hidden_size=768, num_hidden_layers=4,
                           num_attention_heads=12, intermediate_size=3072, max_position_embeddings=256)).save_pretrained(root / "bert")
    wp.save(str(root / "bert" / "tokenizer.json"))
(root / "sft.jsonl").write_text("".join(json.dumps({"prompt": sent(30) + "?", "completion": " " + sent(120)}) + "\n" for _ in range(64)))
(root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
(root / "cls.jsonl").write_text("".join(json.dumps({"text": sent(40), "label": str(i % 2)}) + "\n" for i in range(128)))

def last_elapsed(out):
    """(seconds of the run's steps after the first, steps timed, last logged loss); resets STEP_TIMES."""
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    seconds, timed = sum(STEP_TIMES[1:]), len(STEP_TIMES) - 1
    STEP_TIMES.clear()
    return seconds, timed, rows[-1]["loss"]

res = {}
for prec in ("fp32", "bf16", "fp32", "bf16"):  # alternating: the machine is shared
    STEP_TIMES.clear()
    o = root / f"sft-{prec}-{time.time_ns()}"
    sft(SFTConfig(model=str(root / "gpt2"), train=str(root / "sft.jsonl"), out=str(o), max_steps=6, batch_size=8,
                  max_length=256, precision=prec, log_every=1), log=None)
    res.setdefault(("sft", prec), []).append(last_elapsed(o))
    o = root / f"lora-{prec}-{time.time_ns()}"
    finetune_causal_lm_folder(root / "gpt2", o, "lora", [str(root / "docs.jsonl")], steps=6, batch_size=8, seq_len=256,
                              precision=prec)
    res.setdefault(("lora", prec), []).append(last_elapsed(o))
    o = root / f"cls-{prec}-{time.time_ns()}"
    finetune(FinetuneConfig(model=str(root / "bert"), train=str(root / "cls.jsonl"), out=str(o), epochs=1, batch_size=16,
                            max_length=128, precision=prec, progress=False, lr=3e-5))
    res.setdefault(("classify", prec), []).append(last_elapsed(o))
for job in ("sft", "lora", "classify"):
    f, b = min(r[0] for r in res[(job, "fp32")]), min(r[0] for r in res[(job, "bf16")])
    print(f"{job}: fp32 {f:.2f}s, bf16 {b:.2f}s for {res[(job,'fp32')][0][1]} steps after the first -> {f / b:.2f}x; "
          f"last loss fp32 {res[(job,'fp32')][0][2]:.6f} bf16 {res[(job,'bf16')][0][2]:.6f}")
print(f"{torch.get_num_threads()} threads, {'process CPU' if CLOCK is time.process_time else 'wall-clock'} time, "
      f"load average {os.getloadavg()[0]:.1f}")
