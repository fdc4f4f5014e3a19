"""DPO against TRL's DPOTrainer: tokenized pairs, the first three steps' metrics for every loss type on standard and
conversational rows (tiny GPT-2 and LLaMA, reference != policy), the LoRA reference, precomputed references, bad rows."""
import json

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM, PreTrainedTokenizerFast)

import lmkit  # noqa: E402
from lmkit.errors import LmkitError  # noqa: E402
from lmkit.finetune.dpo import DPOConfig, dpo  # noqa: E402
from lmkit.finetune.preference_data import prepare_pairs  # noqa: E402
from lmkit.finetune.sft import CHATML  # noqa: E402
from helpers.hf_folders import byte_level_bpe, spm_bpe  # noqa: E402

WORDS = "the cat sat on a mat while dogs ran far away; python lists hold items, dicts map keys. Ça va — 中文 ok?".split()


def _text(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n))


def pairs(kind: str, n: int = 6) -> list[dict]:
    """n preference rows of `kind` (standard, conversational, implicit) of uneven lengths."""
    rows = []
    for i in range(n):
        q, good, bad = _text(i, 3 + i % 4), _text(i + 2, 2 + i % 5), _text(i + 9, 1 + (i * 3) % 6)
        if kind == "standard":
            rows.append({"prompt": q + "?", "chosen": " " + good, "rejected": " " + bad})
        elif kind == "implicit":
            rows.append({"chosen": q + "? " + good, "rejected": q + "? " + bad})
        else:
            rows.append({"prompt": [{"role": "user", "content": q}], "chosen": [{"role": "assistant", "content": good}],
                         "rejected": [{"role": "assistant", "content": bad}]})
    return rows


def write(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny random GPT-2 and LLaMA policies and references (other seeds), with a ChatML template."""
    base = tmp_path_factory.mktemp("dpo")
    gpt2_tok = PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
                                       eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    llama_tok = PreTrainedTokenizerFast(tokenizer_object=spm_bpe(), bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="</s>")
    out = {}
    for name, tok in (("gpt2", gpt2_tok), ("llama", llama_tok)):
        tok.chat_template = CHATML
        for role, seed in (("policy", 0), ("ref", 1)):
            torch.manual_seed(seed)
            if name == "gpt2":
                model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=96, n_embd=32, n_layer=2, n_head=2,
                                                   bos_token_id=0, eos_token_id=0))
            else:
                model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                     max_position_embeddings=96, tie_word_embeddings=False))
            folder = base / f"{name}-{role}"
            model.save_pretrained(folder)
            tok.save_pretrained(folder)
            out[name, role] = folder
    return out


def trl_history(policy, ref, rows, tmp, **settings):
    """TRL's logged metrics of each step (logging_steps=1) on the whole set as one batch."""
    from trl import DPOConfig as TRLConfig, DPOTrainer

    args = TRLConfig(output_dir=str(tmp), per_device_train_batch_size=len(rows), logging_steps=1, report_to=[],
                     use_cpu=True, save_strategy="no", dataset_num_proc=None, seed=0, bf16=False, **settings)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(policy),
                         ref_model=None if ref is None else AutoModelForCausalLM.from_pretrained(ref), args=args,
                         train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=PreTrainedTokenizerFast.from_pretrained(policy))
    trainer.train()
    return [h for h in trainer.state.log_history if "rewards/chosen" in h], trainer


NAMES = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
         "logps/rejected")


def ours_history(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_close(theirs, ours):
    assert len(theirs) == len(ours) == 3
    for t, o in zip(theirs, ours):
        for name in NAMES:
            # log-probabilities are sums of ~100 token terms: 1e-5 of their size (1e-5 absolute below 1)
            assert abs(t[name] - o[name]) <= 1e-5 * max(1.0, abs(t[name])), (name, t, o)


LOSSES = [("sigmoid", 0.0), ("ipo", 0.0), ("hinge", 0.0), ("robust", 0.2)]
# every loss on GPT-2; LLaMA's other losses run with the slow tests (the losses do not depend on the family)
CASES = [("gpt2", *loss) for loss in LOSSES] + [("llama", "sigmoid", 0.0)] + [
    pytest.param("llama", *loss, marks=pytest.mark.slow) for loss in LOSSES[1:]]


@pytest.mark.parametrize("name, loss_type, smoothing", CASES)
@pytest.mark.parametrize("kind", ["standard", "conversational"])
def test_first_three_steps_match_trl(folders, tmp_path, name, kind, loss_type, smoothing):
    rows = pairs(kind)
    policy, ref = folders[name, "policy"], folders[name, "ref"]
    max_length = 40 if kind == "standard" else 96  # standard rows: some are cut, as TRL cuts them
    settings = dict(max_steps=3, learning_rate=1e-3, beta=0.5, loss_type=loss_type, label_smoothing=smoothing,
                    max_length=max_length)
    theirs, _ = trl_history(policy, ref, rows, tmp_path / "trl", **settings)
    out = tmp_path / "ours"
    dpo(DPOConfig(model=str(policy), train=str(write(tmp_path / "train.jsonl", rows)), out=str(out),
                  ref_model=str(ref), beta=0.5, loss_type=loss_type, label_smoothing=smoothing, max_length=max_length,
                  batch_size=len(rows), max_steps=3, lr=1e-3, precision="fp32"), log=None)
    assert_close(theirs, ours_history(out))


def test_implicit_prompts_and_tokens_match_trl(folders, tmp_path):
    rows = pairs("implicit")
    _, trainer = trl_history(folders["gpt2", "policy"], None, rows, tmp_path / "trl", max_steps=1, max_length=40)
    theirs = [dict(r) for r in trainer.train_dataset]
    tok = lmkit.load_tokenizer(folders["gpt2", "policy"])
    ours, report = prepare_pairs(tok, write(tmp_path / "train.jsonl", rows), 40)
    assert report["format"] == "implicit_standard"
    assert [(p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in ours] == [
        (r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in theirs]


def _run(folder, tmp_path, name, **settings):
    out = tmp_path / name
    dpo(DPOConfig(model=str(folder), train=str(write(tmp_path / "train.jsonl", pairs("standard"))), out=str(out),
                  max_length=40, batch_size=6, max_steps=3, lr=1e-3, precision="fp32", **settings), log=None)
    return ours_history(out)


def test_precomputed_reference_and_lora_reference(folders, tmp_path):
    policy, ref = folders["gpt2", "policy"], folders["gpt2", "ref"]
    live = _run(policy, tmp_path, "live", ref_model=str(ref))
    assert_close(live, _run(policy, tmp_path, "pre", ref_model=str(ref), precompute_ref=True))
    # LoRA without --ref-model: the reference is the policy with its adapters off, so the first step sees no margin
    lora = _run(policy, tmp_path, "lora", peft="lora", peft_settings={"r": 4})
    assert lora[0]["rewards/chosen"] == lora[0]["rewards/rejected"] == 0.0
    assert lora[2]["rewards/margins"] > 0
    full = _run(policy, tmp_path, "copy")  # the default reference: a frozen copy of the starting model
    assert full[0]["rewards/margins"] == 0.0 and full[0]["logps/chosen"] == lora[0]["logps/chosen"]


@pytest.mark.parametrize("bad, match", [
    ({"prompt": "a", "chosen": " b"}, "no 'rejected'"),
    ({"prompt": "a", "chosen": " b", "rejected": " b"}, "chosen equals rejected"),
    ({"prompt": _text(3, 40), "chosen": " b", "rejected": " c"}, "more than --max-prompt-length 30"),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": " b", "rejected": " c"}, "must be text"),
])
def test_bad_rows_name_the_file_and_line(folders, tmp_path, bad, match):
    tok = lmkit.load_tokenizer(folders["gpt2", "policy"])
    path = write(tmp_path / "bad.jsonl", pairs("standard", 2) + [bad])
    with pytest.raises(LmkitError, match=rf"bad.jsonl:3: .*{match}"):
        prepare_pairs(tok, path, 90, max_prompt_length=30)


def test_cli_refuses_a_prompt_that_fills_max_length_and_writes_nothing(folders, tmp_path, capsys):
    from lmkit.cli import main

    rows = pairs("standard", 2) + [{"prompt": _text(1, 60), "chosen": " yes", "rejected": " no"}]
    out = tmp_path / "out"
    status = main(["finetune", "--task", "dpo", "--model", str(folders["gpt2", "policy"]), "--train",
                   str(write(tmp_path / "t.jsonl", rows)), "--out", str(out), "--max-length", "32"])
    assert status == 2 and not out.exists()
    assert "t.jsonl:3: the prompt is" in capsys.readouterr().err
    status = main(["finetune", "--task", "dpo", "--model", str(folders["gpt2", "policy"]), "--train",
                   str(tmp_path / "t.jsonl"), "--out", str(out), "--label-smoothing", "0.1"])
    assert status == 2 and "robust only" in capsys.readouterr().err
