"""Bad input and interruptions on every command: one clear line, exit 2 (130 for Ctrl-C), and no file lost."""
import json
import math

import pytest
import torch

import lmkit
from lmkit.atomic import atomic_write_bytes, staged_folder
from lmkit.cli import main
from lmkit.config import get_preset
from lmkit.data import prepare as prep
from lmkit.errors import GenerationError
from lmkit.models import build_model

from helpers.faults import SPECIAL, TEXT, fails, snapshot

LATIN1 = "caf\xe9 au lait, ol\xe9\n".encode("latin1") * 20


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("safety")
    texts = [f"Document {i}. " + TEXT * (1 + i % 3) for i in range(40)]
    (root / "corpus.jsonl").write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts)),
                                       encoding="utf-8")
    tok = lmkit.train_tokenizer(texts, kind="bpe", vocab_size=300, special_tokens=SPECIAL)
    tok.save(str(root / "tok.json"))
    torch.manual_seed(0)
    model = build_model(get_preset("tiny", vocab_size=tok.vocab_size, max_seq_len=32))
    model.save_pretrained(root / "model")
    tok.save(str(root / "model" / "tokenizer.json"))
    (root / "latin1.txt").write_bytes(LATIN1)
    return root


def leftovers(folder):
    """Temporary files or folders that a write left beside its target."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp"))


def prepare_args(assets, out, *corpus, shard_mb="0.0005"):
    return ["data", "prepare", "--corpus", *(str(assets / c) for c in corpus), "--tokenizer", str(assets / "tok.json"),
            "--out", str(out), "--workers", "1", "--shard-mb", shard_mb]


# data prepare ----------------------------------------------------------------------------------------

def test_failed_prepare_keeps_the_previous_shard_set(assets, tmp_path, capsys):
    out = tmp_path / "shards"
    assert main(prepare_args(assets, out, "corpus.jsonl")) == 0
    before = snapshot(out)
    assert sum(name.startswith("train-") for name in before) > 2
    # the good file's shards are written before the bad file is reached
    fails(capsys, prepare_args(assets, out, "corpus.jsonl", "latin1.txt") + ["--overwrite"], "not UTF-8")
    assert snapshot(out) == before and leftovers(tmp_path) == []
    assert main(["data", "verify", str(out)]) == 0
    fails(capsys, prepare_args(assets, tmp_path / "new", "corpus.jsonl", "latin1.txt"), "not UTF-8")
    assert not (tmp_path / "new").exists() and leftovers(tmp_path) == []


def test_interrupted_prepare_keeps_the_previous_shard_set(assets, tmp_path, capsys, monkeypatch):
    out = tmp_path / "shards"
    assert main(prepare_args(assets, out, "corpus.jsonl")) == 0
    before = snapshot(out)
    write, calls = prep._write_shard, []

    def ctrl_c_on_the_third(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return write(*args)

    monkeypatch.setattr(prep, "_write_shard", ctrl_c_on_the_third)
    assert main(prepare_args(assets, out, "corpus.jsonl") + ["--overwrite"]) == 130
    assert len(calls) == 3 and snapshot(out) == before and leftovers(tmp_path) == []


def test_overwrite_replaces_the_whole_set_and_keeps_other_files(assets, tmp_path):
    out = tmp_path / "shards"
    assert main(prepare_args(assets, out, "corpus.jsonl")) == 0
    (out / "notes.txt").write_text("mine")
    assert main(prepare_args(assets, out, "corpus.jsonl", shard_mb="16") + ["--overwrite"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["index.json", "notes.txt", "tokenizer.json", "train-00000.safetensors", "validation-00000.safetensors"]
    assert main(["data", "verify", str(out)]) == 0


@pytest.mark.parametrize("flag, value", [("--workers", "0"), ("--workers", "-2"), ("--shard-mb", "0"),
                                         ("--shard-mb", "-1"), ("--shard-mb", "nan")])
def test_prepare_numbers_out_of_range(assets, tmp_path, capsys, flag, value):
    argv = prepare_args(assets, tmp_path / "out", "corpus.jsonl")
    argv[argv.index(flag) + 1] = value
    fails(capsys, argv, flag)
    assert not (tmp_path / "out").exists()


def test_prepare_out_is_a_file(assets, tmp_path, capsys):
    (tmp_path / "f").write_text("keep")
    fails(capsys, prepare_args(assets, tmp_path / "f", "corpus.jsonl"), "is a file")
    assert (tmp_path / "f").read_text() == "keep"


# data clean ------------------------------------------------------------------------------------------

def test_clean_with_no_survivor_writes_nothing(assets, tmp_path, capsys):
    out = tmp_path / "clean.jsonl"
    out.write_text('{"id": "old", "text": "a previous result"}\n')
    fails(capsys, ["data", "clean", "--corpus", str(assets / "corpus.jsonl"), "--out", str(out), "--min-chars", "100000"],
          "no document", "too short", "--min-chars")
    assert out.read_text() == '{"id": "old", "text": "a previous result"}\n'
    assert not (tmp_path / "clean.jsonl.report.json").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("flag, value", [("--bands", "0"), ("--num-perm", "0"), ("--min-chars", "-1"),
                                         ("--max-chars", "0"), ("--min-words", "-1"), ("--boilerplate-min-docs", "-1"),
                                         ("--boilerplate-min-chars", "0")])
def test_clean_numbers_out_of_range(assets, tmp_path, capsys, flag, value):
    fails(capsys, ["data", "clean", "--corpus", str(assets / "corpus.jsonl"), "--out", str(tmp_path / "c.jsonl"),
                   flag, value], flag)
    assert not (tmp_path / "c.jsonl").exists()


def test_writing_a_file_onto_a_folder_names_the_folder(assets, tmp_path, capsys):
    (tmp_path / "d").mkdir()
    err = fails(capsys, ["data", "clean", "--corpus", str(assets / "corpus.jsonl"), "--out", str(tmp_path / "d")],
                tmp_path / "d", "folder")
    assert ".tmp" not in err and list((tmp_path / "d").iterdir()) == []
    with pytest.raises(IsADirectoryError) as info:
        atomic_write_bytes(tmp_path / "d", b"x")
    assert info.value.filename == str(tmp_path / "d")


def test_tokenizer_train_refuses_to_overwrite_its_corpus(assets, tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT * 20)
    fails(capsys, ["tokenizer", "train", "--vocab-size", "280", "--corpus", str(corpus), "--out", str(corpus)],
          "--out", "corpus files")
    assert corpus.read_text() == TEXT * 20


# staged folders ----------------------------------------------------------------------------------------

def test_staged_folder_changes_nothing_on_error_and_moves_the_last_file_last(tmp_path, monkeypatch):
    import lmkit.atomic as atomic

    out = tmp_path / "out"
    out.mkdir()
    for name in ("a", "b", "old-1"):
        (out / name).write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with staged_folder(out) as stage:
            (stage / "a").write_text("new")
            raise KeyboardInterrupt
    assert {p.name: p.read_text() for p in out.iterdir()} == {"a": "old", "b": "old", "old-1": "old"}
    assert leftovers(tmp_path) == []
    moved, replace = [], atomic.os.replace
    monkeypatch.setattr(atomic.os, "replace", lambda src, dst: moved.append(dst.name) or replace(src, dst))
    with staged_folder(out, last=("a",), remove=lambda f: f.name.startswith("old-")) as stage:
        for name in ("a", "c", "z"):
            (stage / name).write_text("new")
    assert moved == ["c", "z", "a"]
    assert {p.name: p.read_text() for p in out.iterdir()} == {"a": "new", "b": "old", "c": "new", "z": "new"}
    with staged_folder(tmp_path / "fresh") as stage:
        (stage / "x").write_text("1")
    assert (tmp_path / "fresh" / "x").read_text() == "1" and leftovers(tmp_path) == []


# compression and fine-tuning outputs ---------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["distill", "--teacher", "{m}", "--out", "{o}", "--max-steps", "1"],
                                  ["prune", "--model", "{m}", "--out", "{o}", "--heads", "1"],
                                  ["quantize", "--model", "{m}", "--out", "{o}"],
                                  ["finetune", "--task", "clm", "--model", "{m}", "--train", "{c}", "--out", "{o}"],
                                  ["finetune", "--model", "{m}", "--train", "{c}", "--out", "{o}"]])
def test_out_that_is_the_input_model_is_refused(assets, tmp_path, capsys, argv):
    before = snapshot(assets / "model")
    for out in (assets / "model", f"{assets}/./model/"):
        args = [a.format(m=assets / "model", o=out, c=assets / "corpus.jsonl") for a in argv]
        fails(capsys, args + ([] if "--train" in argv else ["--corpus", str(assets / "corpus.jsonl")]),
              "--out", "would overwrite it")
    assert snapshot(assets / "model") == before


def test_interrupted_model_write_keeps_the_previous_folder(assets, tmp_path, capsys, monkeypatch):
    out = tmp_path / "q"
    args = ["quantize", "--model", str(assets / "model"), "--corpus", str(assets / "corpus.jsonl"), "--out", str(out)]
    assert main(args) == 0
    before = snapshot(out)
    from lmkit.tokenizers.tokenizer import Tokenizer

    def interrupted(self, path):  # the weights and config are written by now
        raise KeyboardInterrupt

    monkeypatch.setattr(Tokenizer, "save", interrupted)
    assert main(args) == 130
    assert snapshot(out) == before and leftovers(tmp_path) == []


@pytest.mark.parametrize("flag, value, needle", [("--max-steps", "0", "--max-steps"), ("--batch-size", "0", "--batch-size"),
                                                 ("--lr", "nan", "--lr"), ("--seq-len", "0", "at least 1"),
                                                 ("--seq-len", "64", "32 positions")])
def test_distill_numbers_out_of_range(assets, tmp_path, capsys, flag, value, needle):
    args = {"--max-steps": "1", "--batch-size": "2", "--seq-len": "16", flag: value}
    fails(capsys, ["distill", "--teacher", str(assets / "model"), "--out", str(tmp_path / "s"), "--corpus",
                   str(assets / "corpus.jsonl"), *[x for kv in args.items() for x in kv]], needle)
    assert not (tmp_path / "s").exists()


def test_finetune_length_longer_than_the_context(assets, tmp_path, capsys):
    fails(capsys, ["finetune", "--task", "clm", "--model", str(assets / "model"), "--train", str(assets / "corpus.jsonl"),
                   "--max-length", "128", "--out", str(tmp_path / "f")], "128", "32 positions", "--max-length 32")


def test_int8_model_cannot_be_distilled_or_pruned(assets, tmp_path, capsys):
    q = tmp_path / "q"
    assert main(["quantize", "--model", str(assets / "model"), "--corpus", str(assets / "corpus.jsonl"), "--out", str(q)]) == 0
    for argv in (["distill", "--teacher", str(q), "--max-steps", "1"], ["prune", "--model", str(q), "--heads", "1"]):
        fails(capsys, argv + ["--out", str(tmp_path / "o"), "--corpus", str(assets / "corpus.jsonl")], "int8", "float model")


# generation and evaluation --------------------------------------------------------------------------

def test_nan_temperature_is_a_clear_error(assets, capsys):
    fails(capsys, ["generate", "--model", str(assets / "model"), "--prompt", "hello", "--temperature", "nan"],
          "temperature")
    model = lmkit.load_model(assets / "model")
    for t in (math.nan, math.inf):
        with pytest.raises(GenerationError, match="temperature"):
            model.generate(torch.tensor([[1, 2]]), do_sample=True, temperature=t, max_new_tokens=2)


def test_pairs_sources_end_with_eos_as_in_training(tmp_path):
    """`lmkit eval --pairs` feeds each source as training did (span/denoise and the numbers task: ids + EOS)."""
    from tokenizers import Tokenizer as HFTokenizer

    from lmkit.data.translation import task_tokenizer
    from lmkit.evaluate.seq2seq import encode_pairs, encode_source, reference_loss, translate

    tok = task_tokenizer()
    eos = tok.token_to_id("</s>")
    torch.manual_seed(0)
    model = build_model(get_preset("t5-tiny", vocab_size=tok.vocab_size, pad_token_id=0, eos_token_id=eos,
                                   decoder_start_token_id=0)).eval()
    sources = ["12 plus 3", "7"]
    want = [tok.encode(s, add_special_tokens=False) + [eos] for s in sources]
    assert encode_pairs(model, tok, [(s, "") for s in sources])[0] == want  # what fit_pairs trains on
    seen = []  # (input_ids, attention_mask) of every encoder pass
    model.encoder.register_forward_pre_hook(lambda m, args, kw: seen.append((args[0], kw["attention_mask"])),
                                            with_kwargs=True)
    translate(model, tok, sources, max_new_tokens=2)
    reference_loss(model, tok, list(zip(sources, ["15", "7"])))
    assert len(seen) >= 2
    for ids, mask in seen:
        assert [row[m.bool()].tolist() for row, m in zip(ids, mask)] == want
    # the task's tokenizer ends texts with EOS itself, as T5's does, in `tokenizers` too (transformers users
    # feed what training fed); a tokenizer without that post-processor gets EOS appended, never twice
    tok.save(str(tmp_path / "t.json"))
    assert [HFTokenizer.from_file(str(tmp_path / "t.json")).encode(s).ids for s in sources] == want
    assert [encode_source(tok, s, eos) for s in sources] == want
    tok.post_processor = None
    assert [encode_source(tok, s, eos) for s in sources] == want


def test_search_with_no_passage_long_enough(tmp_path, capsys, minilm_path):
    model = minilm_path
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT * 3)
    fails(capsys, ["search", "--model", str(model), "--query", "fox", "--corpus", str(corpus), "--min-chars", "100000",
                   "--no-cache"], "no paragraph", "--min-chars")


def test_ctrl_c_while_the_commands_load(capsys, monkeypatch):
    import lmkit.cli as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert main(["train"]) == 130
    assert capsys.readouterr().err == "lmkit: interrupted\n"


@pytest.mark.parametrize("settings, needle", [({"method": "lora", "dropout": 1.5}, "--lora-dropout"),
                                              ({"method": "lora", "dropout": math.nan}, "--lora-dropout"),
                                              ({"method": "prompt", "num_virtual_tokens": 0}, "--virtual-tokens"),
                                              ({"method": "prefix", "num_virtual_tokens": -1}, "--virtual-tokens"),
                                              ({"method": "adapter", "bottleneck": 0}, "--bottleneck")])
def test_peft_settings_out_of_range(settings, needle):
    from lmkit.errors import ConfigError
    from lmkit.peft.model import PeftConfig

    with pytest.raises(ConfigError, match=needle):
        PeftConfig(**settings)


@pytest.mark.parametrize("exc, size", [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
                  "to allocate 800000000000 bytes. Error code 12 (Cannot allocate memory)"), "800000000000 bytes"),
    (MemoryError("Unable to allocate 75.0 GiB for an array"), None)])
def test_out_of_memory_is_a_clear_error(assets, capsys, monkeypatch, exc, size):
    import lmkit.cli.quantize as command

    def run(args):
        raise exc

    monkeypatch.setattr(command, "run", run)
    err = fails(capsys, ["quantize", "--model", str(assets / "model")], "out of memory", "--batch-size")
    assert size is None or size in err
    exc = RuntimeError("a bug")
    monkeypatch.setattr(command, "run", run)
    with pytest.raises(RuntimeError, match="a bug"):  # other errors are bugs and still raise
        main(["quantize", "--model", str(assets / "model")])


def test_demo_never_deletes_a_run_it_did_not_make(assets, tmp_path, capsys):
    run = tmp_path / "precious"
    assert main(["train", "--preset", "tiny", "--corpus", str(assets / "corpus.jsonl"), "--out", str(run),
                 "--max-steps", "1", "--batch-size", "2", "--seq-len", "16"]) == 0
    before = snapshot(run)
    fails(capsys, ["demo", "--out", str(run), "--time-budget", "1"], run, "did not make", "another --out")
    assert snapshot(run) == before


def test_text_that_is_not_utf8(assets, capsys, monkeypatch):
    """Python keeps undecodable bytes of argv (and stdin) as lone surrogates: refused with the byte named."""
    import io
    import sys
    from types import SimpleNamespace

    bad = "caf\udce9"  # what `--prompt $'caf\xe9'` becomes
    fails(capsys, ["generate", "--model", str(assets / "model"), "--prompt", bad], "--prompt", "not UTF-8", "0xe9")
    fails(capsys, ["tokenizer", "encode", "--tokenizer", str(assets / "tok.json"), bad], "not UTF-8", "0xe9")
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=io.BytesIO(LATIN1)))
    fails(capsys, ["tokenizer", "encode", "--tokenizer", str(assets / "tok.json")], "stdin", "not UTF-8", "0xe9")
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=io.BytesIO("café".encode())))
    assert main(["tokenizer", "encode", "--tokenizer", str(assets / "tok.json")]) == 0
    assert "5 bytes" in capsys.readouterr().out
