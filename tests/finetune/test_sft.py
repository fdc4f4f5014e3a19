"""Supervised fine-tuning against TRL's SFTTrainer: prepared ids, labels and position ids for the three row formats
with and without packing, the first-step loss, packing without cross-example attention, the CLI and its errors."""
import json
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM, PreTrainedTokenizerFast)

import lmkit  # noqa: E402
from lmkit.errors import LmkitError  # noqa: E402
from lmkit.finetune.sft import SFTConfig, collate, sft, step_loss  # noqa: E402
from lmkit.finetune.sft_data import prepare  # noqa: E402

TEMPLATE = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5_training.jinja").read_text()
WORDS = ("the cat sat on a mat while dogs ran far away; python lists hold items, dicts map keys to values. "
         "Ça va très bien — 中文 ok? ").split()


def _sentence(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n))


def _rows(kind: str, n: int = 10) -> list[dict]:
    rows = []
    for i in range(n):
        q, a = _sentence(i, 3 + i % 5), _sentence(i + 3, 2 + (i * 3) % 9)
        if kind == "text":
            rows.append({"text": q + " " + a})
        elif kind == "prompt_completion":
            rows.append({"prompt": q + "?", "completion": " " + a})
        elif kind == "conv_prompt_completion":
            rows.append({"prompt": [{"role": "user", "content": q}], "completion": [{"role": "assistant", "content": a}]})
        else:
            msgs = ([{"role": "system", "content": "Be brief."}] if i % 2 else []) + [
                {"role": "user", "content": q}, {"role": "assistant", "content": a}]
            if i % 3 == 0:
                msgs += [{"role": "user", "content": _sentence(i + 5, 3)}, {"role": "assistant", "content": _sentence(i, 4)}]
            rows.append({"messages": msgs})
    return rows


def _long_prompt_rows(kind: str, max_length: int) -> list[dict]:
    """Two rows whose prompt alone passes max_length (every word is a token or more)."""
    out = []
    for i in range(2):
        q, a = _sentence(i + 11, max_length + 3), _sentence(i, 3)
        if kind == "prompt_completion":
            out.append({"prompt": q, "completion": " " + a})
        elif kind == "conv_prompt_completion":
            out.append({"prompt": [{"role": "user", "content": q}], "completion": [{"role": "assistant", "content": a}]})
        else:
            out.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny random GPT-2 and LLaMA folders saved by transformers, with a BPE tokenizer and a generation template."""
    base = tmp_path_factory.mktemp("sft")
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator([" ".join(WORDS)] * 20 + [_sentence(i, 12) for i in range(50)],
                           trainers.BpeTrainer(vocab_size=330, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                               special_tokens=["<|endoftext|>"], show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(tk.to_str()), eos_token="<|endoftext|>",
                            pad_token="<|endoftext|>").save_pretrained(base / "plain")
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                     extra_special_tokens=["<|im_start|>", "<|im_end|>"])
    hf_tok.chat_template = TEMPLATE
    V = len(hf_tok)
    out = {}
    torch.manual_seed(0)
    for name, model in (("gpt2", GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=128, n_embd=32, n_layer=2,
                                                                n_head=2, bos_token_id=0, eos_token_id=0, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))),
                        ("llama", LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                                               num_hidden_layers=2, num_attention_heads=4,
                                                               num_key_value_heads=2, max_position_embeddings=128,
                                                               tie_word_embeddings=False)))):
        folder = base / name
        model.save_pretrained(folder)
        hf_tok.save_pretrained(folder)
        out[name] = folder
    out["plain_tokenizer"] = base / "plain"
    return out


def _trl(folder, rows, tmp, packing, max_length, train_on_all=False):
    from trl import SFTConfig as TRLConfig, SFTTrainer

    conversational = "messages" in rows[0] or isinstance(rows[0].get("prompt"), list)
    args = TRLConfig(output_dir=str(tmp), max_length=max_length, packing=packing, report_to=[],
                     assistant_only_loss=conversational and not train_on_all,
                     completion_only_loss=False if train_on_all else None, per_device_train_batch_size=4,
                     use_cpu=True, dataset_num_proc=None, seed=0)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    return SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tok)


CASES = [("gpt2", k) for k in ("text", "prompt_completion", "conv_prompt_completion", "messages")] + [
    ("llama", "prompt_completion"), ("llama", "messages")]


@pytest.mark.parametrize("name, kind", CASES)
@pytest.mark.parametrize("packing", [False, True])
def test_prepared_rows_and_first_loss_match_trl(folders, tmp_path, name, kind, packing):
    max_length = (24 if kind in ("text", "prompt_completion") else 100) + (28 if packing else 0)
    # prompts longer than max_length leave their rows no trained token: TRL drops them, but packs them when packing
    cut = [] if kind == "text" else _long_prompt_rows(kind, max_length)
    rows = _rows(kind)[:4] + cut + _rows(kind)[4:]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    trainer = _trl(folders[name], rows, tmp_path / "trl", packing, max_length)
    theirs = [dict(r) for r in trainer.train_dataset]
    tok = lmkit.load_tokenizer(folders[name])
    ours, report = prepare(tok, path, max_length, packing=packing)
    assert report["rows"] == len(rows)
    assert (report["dropped"], report.get("untrained")) == ((0, len(cut)) if packing else (len(cut), None))
    assert len(theirs) == (report["packed_rows"] if packing else len(rows) - len(cut))
    assert [e.input_ids for e in ours] == [r["input_ids"] for r in theirs]
    if packing:
        assert [e.seq_lengths for e in ours] == [r["seq_lengths"] for r in theirs]
    else:
        assert [e.labels for e in ours] == [r["labels"] for r in theirs]
    hf_batch = trainer.data_collator(theirs[:4])
    batch = collate(ours[:4], tok.pad_token_id)
    mask = batch["attention_mask"]
    if packing:  # TRL flattens the packed rows into one padding-free row
        real = batch["labels"] != -100
        flat = lambda t: torch.cat([t[i, :len(ours[i].input_ids)] for i in range(len(ours[:4]))])[None]  # noqa: E731
        assert torch.equal(flat(batch["input_ids"]), hf_batch["input_ids"])
        assert torch.equal(flat(batch["position_ids"]), hf_batch["position_ids"])
        assert torch.equal(flat(batch["labels"]), hf_batch["labels"])
        assert real.any()
    else:
        assert torch.equal(batch["input_ids"], hf_batch["input_ids"])
        assert torch.equal(batch["labels"], hf_batch["labels"])
        assert torch.equal(mask, hf_batch["attention_mask"])
    theirs_loss = float(trainer.compute_loss(trainer.model, {k: v for k, v in hf_batch.items()}))
    model = lmkit.load_model(folders[name])
    ours_loss, _ = step_loss(model, [batch])
    assert abs(ours_loss - theirs_loss) < 1e-5, (ours_loss, theirs_loss)


def test_micro_batches_give_the_token_weighted_mean_of_the_step(folders, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows("messages")))
    tok, model = lmkit.load_tokenizer(folders["gpt2"]), lmkit.load_model(folders["gpt2"])
    ex, _ = prepare(tok, path, 64)
    whole, n = step_loss(model, [collate(ex[:6], tok.pad_token_id)])
    parts, m = step_loss(model, [collate(ex[i:i + 2], tok.pad_token_id) for i in (0, 2, 4)])
    uneven, _ = step_loss(model, [collate(ex[:1], tok.pad_token_id), collate(ex[1:6], tok.pad_token_id)])
    assert n == m and abs(whole - parts) < 1e-5 and abs(whole - uneven) < 1e-5
    # a mean of per-micro-batch means would differ: the micro-batches hold different token counts
    means = [step_loss(model, [collate(ex[i:i + 2], tok.pad_token_id)])[0] for i in (0, 2, 4)]
    assert abs(sum(means) / 3 - whole) > 1e-4


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_packed_row_scores_each_example_as_if_alone(folders, tmp_path, name):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows("prompt_completion")))
    tok, model = lmkit.load_tokenizer(folders[name]), lmkit.load_model(folders[name])
    packed, _ = prepare(tok, path, 128, packing=True)
    row = next(p for p in packed if len(p.seq_lengths) >= 3)
    batch = collate([row], tok.pad_token_id)
    with torch.no_grad():
        logp = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                     position_ids=batch["position_ids"]).logits.log_softmax(-1)[0]
    start = 0
    for n in row.seq_lengths:
        ids = row.input_ids[start:start + n]
        with torch.no_grad():
            single = model(torch.tensor([ids])).logits.log_softmax(-1)[0]
        assert torch.allclose(logp[start:start + n], single, atol=1e-5)
        start += n


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize("bad, match", [
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]}', "unknown role 'wizard'"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}', "empty assistant turn"),
    ('{"prompt": "only a prompt"}', "needs both"),
    ('{"messages": [{"content": "no role"}]}', "needs a \\\"role\\\""),
    ('not json', "not a JSON object"),
])
def test_bad_rows_name_the_file_and_line(folders, tmp_path, bad, match):
    path = _write(tmp_path / "bad.jsonl", _rows("messages", 2) + [bad])
    with pytest.raises(LmkitError, match=rf"bad.jsonl:3: .*{match}"):
        prepare(lmkit.load_tokenizer(folders["gpt2"]), path, 64)


def test_non_utf8_and_dropped_rows(folders, tmp_path):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(LmkitError, match=r"bytes.jsonl:2: bytes that are not UTF-8"):
        prepare(lmkit.load_tokenizer(folders["gpt2"]), path, 64)
    long_prompt = {"prompt": _sentence(1, 40), "completion": " yes"}
    path = _write(tmp_path / "drop.jsonl", [long_prompt, {"prompt": "a?", "completion": " b"}])
    ex, report = prepare(lmkit.load_tokenizer(folders["gpt2"]), path, 16)
    assert report["dropped"] == 1 and len(ex) == 1


def _run(*args):
    """`lmkit ARGS` in this process: (exit status, stderr)."""
    import contextlib
    import io

    from lmkit.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([str(a) for a in args])
    return code, err.getvalue()


def test_cli_refuses_a_base_model_without_template_and_writes_nothing(folders, tmp_path):
    base = tmp_path / "base"
    model = lmkit.load_model(folders["gpt2"])
    model.save_pretrained(base)
    tok = lmkit.load_tokenizer(folders["gpt2"])
    tok.chat_template = None
    tok.save_pretrained(base)
    data = _write(tmp_path / "c.jsonl", _rows("messages", 4))
    code, err = _run("finetune", "--task", "sft", "--model", base, "--train", data, "--out", tmp_path / "out")
    assert code == 2 and "--chat-template chatml" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    bad = _write(tmp_path / "b.jsonl", _rows("messages", 2) + ['{"messages": []}'])
    code, err = _run("finetune", "--task", "sft", "--model", folders["gpt2"], "--train", bad, "--out", tmp_path / "out")
    assert code == 2 and "b.jsonl:3" in err
    code, err = _run("finetune", "--task", "sft", "--model", folders["gpt2"], "--train", data, "--out", tmp_path / "ok",
                     "--max-steps", "2", "--batch-size", "2", "--packing", "--max-length", "128")
    assert code == 0, err
    assert lmkit.load_tokenizer(tmp_path / "ok").chat_template == TEMPLATE
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("peft", ["full", "lora"])
def test_chatml_adds_tokens_resizes_and_trains_the_new_rows(folders, tmp_path, peft):
    base = tmp_path / "base"
    plain = lmkit.load_tokenizer(folders["plain_tokenizer"])  # no ChatML tokens, no template
    plain.save_pretrained(base)
    V = plain.vocab_size
    torch.manual_seed(1)  # a base model whose vocabulary is its tokenizer's
    LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 tie_word_embeddings=peft == "lora")).save_pretrained(base)
    old = lmkit.load_model(base)
    data = _write(tmp_path / "c.jsonl", _rows("messages", 8))
    out = tmp_path / "out"
    report = sft(SFTConfig(model=str(base), train=str(data), out=str(out), chat_template="chatml", max_steps=3,
                           batch_size=4, peft=peft, peft_settings={"r": 4} if peft == "lora" else {}), log=None)
    tuned, tok3 = lmkit.load_model(out), lmkit.load_tokenizer(out)
    assert report["added_tokens"] == 2 and tuned.config.vocab_size == V + 2 == tok3.vocab_size
    assert tok3.chat_template and "<|im_start|>" in tok3.apply_chat_template(_rows("messages", 1)[0]["messages"],
                                                                             tokenize=False)
    emb0, emb1 = old.get_input_embeddings().weight, tuned.get_input_embeddings().weight
    mean = emb0.mean(0)
    assert not torch.allclose(emb1[V + 1], mean)  # <|im_end|> is a trained label: its rows moved
    if peft == "lora":
        assert torch.equal(emb1[:V], emb0)  # under LoRA the old rows stay as they were
    assert (out / "sft.json").is_file() and (out / "chat_template.jinja").is_file()
    # every chat surface reads the same sampling and stops at the turn's end, as transformers' generate would
    written = json.loads((out / "generation_config.json").read_text())
    assert written["do_sample"] is True and written["temperature"] == 0.7 and written["top_p"] == 0.9
    ends = written["eos_token_id"]
    assert tok3.token_to_id("<|im_end|>") in (ends if isinstance(ends, list) else [ends])
    from transformers import GenerationConfig

    assert GenerationConfig.from_pretrained(out).eos_token_id == ends
