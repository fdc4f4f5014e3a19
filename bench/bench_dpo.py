"""DPO step time: lmkit `finetune --task dpo` against TRL's DPOTrainer, same model, same pairs, same batch, fp32
(docs/alignment.md). Usage: python bench/bench_dpo.py OUT_DIR [THREADS]

What counts: whole optimizer steps (collation, policy and reference forwards, backward, clipping, AdamW): lmkit's
TrainLoop.train_step, TRL's from on_step_begin to on_step_end. The first step of each run is left out (one-time
warm-up), the median of the others counts; with one thread (the default) the clock is the process's CPU time, so
that waiting for a core shared with other jobs does not count. The two run alternately, twice; the faster counts."""
import json
import statistics
import sys
import time
from pathlib import Path

import datasets
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, TrainerCallback
from trl import DPOConfig as TRLConfig, DPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.machine import cpu_name  # noqa: E402
from lmkit.finetune.dpo import DPOConfig, dpo  # noqa: E402
from lmkit.train.loop import TrainLoop  # noqa: E402
from tests.helpers.hf_folders import byte_level_bpe  # noqa: E402  (run from the repository root)

root = Path(sys.argv[1])
root.mkdir(parents=True, exist_ok=True)
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
CLOCK = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
STEPS, PAIRS, MAX_LENGTH = 6, 8, 128
WORDS = ("the list holds items and a dict maps keys to values while a set keeps unique members; generators yield "
         "values lazily, context managers close files, decorators wrap functions and classes hold methods").split()
times: list[float] = []
_train_step = TrainLoop.train_step


def timed(self, step):
    start = CLOCK()
    loss = _train_step(self, step)
    times.append(CLOCK() - start)
    return loss


TrainLoop.train_step = timed


class Clock(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        self.start = CLOCK()

    def on_step_end(self, args, state, control, **kw):
        times.append(CLOCK() - self.start)


def text(i, n):
    return " ".join(WORDS[(i * 5 + k * 7) % len(WORDS)] for k in range(n))


rows = [{"prompt": text(i, 20) + "?", "chosen": " " + text(i + 3, 30 + i % 7), "rejected": " " + text(i + 8, 25 + i % 5)}
        for i in range(PAIRS)]
(root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
tok = PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(["<|endoftext|>"], vocab_size=2000),
                              eos_token="<|endoftext|>", pad_token="<|endoftext|>")
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=256, n_embd=256, n_layer=4, n_head=4))
for name in ("policy", "ref"):
    model.save_pretrained(root / name)
    tok.save_pretrained(root / name)
    torch.manual_seed(1)
    model = GPT2LMHeadModel(model.config)


def run_lmkit(i):
    times.clear()
    dpo(DPOConfig(model=str(root / "policy"), train=str(root / "pairs.jsonl"), out=str(root / f"lmkit{i}"),
                  ref_model=str(root / "ref"), batch_size=PAIRS, max_steps=STEPS, lr=1e-5, max_length=MAX_LENGTH,
                  precision="fp32"), log=None)
    return statistics.median(times[1:])


def run_trl(i):
    times.clear()
    args = TRLConfig(output_dir=str(root / f"trl{i}"), per_device_train_batch_size=PAIRS, max_steps=STEPS,
                     learning_rate=1e-5, max_length=MAX_LENGTH, bf16=False, use_cpu=True, report_to=[],
                     save_strategy="no", logging_steps=1, dataset_num_proc=None, disable_tqdm=True)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(root / "policy"),
                         ref_model=AutoModelForCausalLM.from_pretrained(root / "ref"), args=args,
                         train_dataset=datasets.Dataset.from_list(rows), processing_class=tok, callbacks=[Clock()])
    trainer.train()
    return statistics.median(times[1:])


best = {"lmkit": float("inf"), "trl": float("inf")}
for i in range(2):
    best["lmkit"] = min(best["lmkit"], run_lmkit(i))
    best["trl"] = min(best["trl"], run_trl(i))
result = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "model": "GPT-2 4x256, vocab 2000",
          "pairs_per_step": PAIRS, "max_length": MAX_LENGTH, "lmkit_step_s": round(best["lmkit"], 4),
          "trl_step_s": round(best["trl"], 4), "speedup": round(best["trl"] / best["lmkit"], 2)}
print(json.dumps(result))
(root / "bench_dpo.json").write_text(json.dumps(result, indent=2))
