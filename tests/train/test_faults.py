"""Bad input: each gives one clear line naming the file and the fix, exit status 2, and damages no file."""
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import lmkit
from lmkit.cli import main
from lmkit.config import get_preset
from lmkit.data.prepare import prepare
from lmkit.models import build_model
from helpers.faults import SPECIAL, TEXT, fails, snapshot


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    tok = lmkit.train_tokenizer([TEXT * 3, "hello world " * 20], kind="bpe", vocab_size=300, special_tokens=SPECIAL)
    tok.save(str(root / "tok.json"))
    model = build_model(get_preset("tiny", vocab_size=tok.vocab_size))
    model.save_pretrained(root / "model")
    tok.save(str(root / "model" / "tokenizer.json"))
    (root / "corpus.txt").write_text(TEXT * 200, encoding="utf-8")  # several documents
    return root


@pytest.fixture
def model_copy(assets, tmp_path):
    shutil.copytree(assets / "model", tmp_path / "m")
    return tmp_path / "m"


def evaluate(folder, assets):
    return ["eval", "--model", str(folder), "--corpus", str(assets / "corpus.txt")]


# model folders -------------------------------------------------------------------------------------

def test_good_model_folder_evaluates(assets, capsys):
    assert main(evaluate(assets / "model", assets)) == 0


@pytest.mark.parametrize("damage", ["not json", "truncated", "a list"])
def test_malformed_config_json(assets, model_copy, capsys, damage):
    path = model_copy / "config.json"
    raw = path.read_bytes()
    path.write_bytes({"not json": b"{model_type: gpt2", "truncated": raw[: len(raw) // 2], "a list": b"[1, 2]"}[damage])
    before = snapshot(model_copy)
    fails(capsys, evaluate(model_copy, assets), path, "config.json")
    assert snapshot(model_copy) == before


def test_truncated_safetensors(assets, model_copy, capsys):
    path = model_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    before = snapshot(model_copy)
    fails(capsys, evaluate(model_copy, assets), path, "truncated", "re-save")
    assert snapshot(model_copy) == before


@pytest.mark.parametrize("name", ["transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_fc.weight",
                                  "transformer.wte.weight"])
def test_tensor_of_the_wrong_shape(assets, model_copy, capsys, name):
    tensors = load_file(str(model_copy / "model.safetensors"))
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, str(model_copy / "model.safetensors"))
    before = snapshot(model_copy)
    fails(capsys, evaluate(model_copy, assets), name, "shape", "disagree")
    assert snapshot(model_copy) == before


def test_config_with_more_layers_than_the_weights(assets, model_copy, capsys):
    path = model_copy / "config.json"
    config = json.loads(path.read_text())
    config["n_layer"] += 1
    path.write_text(json.dumps(config))
    before = snapshot(model_copy)
    fails(capsys, evaluate(model_copy, assets), "transformer.h.", "config.json", "disagree")
    assert snapshot(model_copy) == before


def test_tokenizer_that_does_not_fit_the_model(assets, model_copy, capsys):
    big = lmkit.train_tokenizer([TEXT * 30 + "zebra quartz vortex jinx " * 30], kind="bpe", vocab_size=400,
                                special_tokens=SPECIAL)
    big.save(str(model_copy / "tokenizer.json"))
    before = snapshot(model_copy)
    fails(capsys, evaluate(model_copy, assets), model_copy / "tokenizer.json", "embeds only 300",
          "use the tokenizer.json saved with that model")
    # generate too: a prompt of small ids would otherwise run and hide the mismatch
    fails(capsys, ["generate", "--model", str(model_copy), "--prompt", "The", "--max-new-tokens", "2"],
          model_copy / "tokenizer.json", "embeds only 300")
    assert snapshot(model_copy) == before


# corpora ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("content, needles", [(b"", ["empty"]), (b"  \n\n \t\n", ["empty"]),
                                              (b"caf\xe9 au lait\n", ["not UTF-8", "byte 3", "iconv"])])
def test_empty_or_non_utf8_corpus(assets, tmp_path, capsys, content, needles):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    out = tmp_path / "out"
    fails(capsys, ["train", "--preset", "tiny", "--corpus", str(bad), "--out", str(out), "--max-steps", "1"], *needles)
    assert not (out / "checkpoint").exists() and not (out / "model.safetensors").exists()
    fails(capsys, ["data", "prepare", "--corpus", str(bad), "--tokenizer", str(assets / "tok.json"), "--out", str(out),
                   "--workers", "1"], *needles)
    assert not (out / "index.json").exists()  # no index: the folder never looks prepared
    fails(capsys, ["data", "clean", "--corpus", str(bad), "--out", str(tmp_path / "clean.jsonl")], *needles)
    assert not (tmp_path / "clean.jsonl").exists()


def test_eval_scores_a_held_out_file_whole(assets, tmp_path, capsys):
    """A file the model never trained on is held out already: all of it is scored, even one short document
    (a train/validation split would need two)."""
    (tmp_path / "held_out.txt").write_text(TEXT, encoding="utf-8")
    assert main(["eval", "--model", str(assets / "model"), "--corpus", str(tmp_path / "held_out.txt")]) == 0
    out = capsys.readouterr().out
    assert "(all 1 documents" in out and "bits per byte" in out


def test_unwritable_output_path_is_one_line(assets, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    fails(capsys, ["tokenizer", "train", "--kind", "bpe", "--vocab-size", "300", "--no-progress",
                   "--corpus", str(assets / "corpus.txt"), "--out", str(tmp_path / "file" / "tok.json")], "cannot use")


# shards -------------------------------------------------------------------------------------------

@pytest.fixture
def shards(assets, tmp_path):
    prepare([str(assets / "corpus.txt")], assets / "tok.json",
            tmp_path / "data", workers=1, val_fraction=0.3, shard_bytes=800)
    return tmp_path / "data"


def _index(folder):
    return json.loads((folder / "index.json").read_text())


def _first_shard(folder):
    return folder / _index(folder)["splits"]["train"]["shards"][0]["file"]


@pytest.mark.parametrize("damage", ["truncated", "flipped", "missing", "count", "index json", "extra tokens"])
def test_shard_index_that_does_not_match_its_files(shards, capsys, damage):
    shard = _first_shard(shards)
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-10])
        needles = [shard, "truncated"]
    elif damage == "flipped":
        blob = bytearray(shard.read_bytes())
        blob[-3] ^= 0x55
        shard.write_bytes(bytes(blob))
        needles = [shard, "sha256"]
    elif damage == "missing":
        shard.unlink()
        needles = [shard, "missing"]
    elif damage == "count":
        index = _index(shards)
        index["splits"]["train"]["shards"][0]["num_tokens"] += 1
        index["splits"]["train"]["num_tokens"] += 1
        (shards / "index.json").write_text(json.dumps(index))
        needles = [shard, "tokens"]
    elif damage == "index json":
        (shards / "index.json").write_text('{"format": "lmkit-token-shards", "version": 1,')
        needles = [shards / "index.json", "not valid JSON"]
    else:
        index = _index(shards)
        index["splits"]["train"]["num_tokens"] += 5
        (shards / "index.json").write_text(json.dumps(index))
        needles = [shards / "index.json", "train"]
    before = snapshot(shards)
    fails(capsys, ["data", "verify", str(shards)], *needles, "lmkit data prepare")
    fails(capsys, ["train", "--preset", "tiny", "--data", str(shards), "--out", str(shards.parent / "run"),
                   "--max-steps", "1"], *needles)
    assert snapshot(shards) == before and not (shards.parent / "run" / "checkpoint").exists()


def test_data_and_corpus_together_is_refused(shards, assets, tmp_path, capsys):
    out = tmp_path / "run"
    fails(capsys, ["train", "--preset", "tiny", "--data", str(shards), "--corpus", str(assets / "corpus.txt"),
                   "--out", str(out), "--max-steps", "1"], "--data", "--corpus")
    assert not out.exists()


def test_prepared_folder_without_validation_split(assets, tmp_path, capsys):
    shards = tmp_path / "data"
    prepare([str(assets / "corpus.txt")], assets / "tok.json", shards, workers=1, val_fraction=0.0)
    fails(capsys, ["train", "--preset", "tiny", "--data", str(shards), "--out", str(shards.parent / "run"),
                   "--max-steps", "1"], "validation", "--val-fraction")


def test_prepare_refuses_to_overwrite(shards, assets, capsys):
    before = snapshot(shards)
    fails(capsys, ["data", "prepare", "--corpus", str(assets / "corpus.txt"), "--tokenizer", str(assets / "tok.json"),
                   "--out", str(shards)], shards, "--overwrite")
    assert snapshot(shards) == before


# resume ----------------------------------------------------------------------------------------------

def test_resume_without_a_checkpoint(assets, tmp_path, capsys):
    out = tmp_path / "run"
    fails(capsys, ["train", "--preset", "tiny", "--corpus", str(assets / "corpus.txt"), "--out", str(out), "--resume"],
          out, "no checkpoint", "drop --resume")
    assert not out.exists()


def test_nothing_is_ever_unpickled():
    """Only safetensors and JSON are read: no pickle, and torch.load only with weights_only=True."""
    import re

    src = Path(lmkit.__file__).parent
    for path in src.rglob("*.py"):
        code = path.read_text(encoding="utf-8")
        assert not re.search(r"^\s*(import pickle|from pickle|import dill|import joblib)", code, re.M), path
        assert not re.search(r"\bpickle\.loads?\(|np\.load\(", code), path
        for call in re.finditer(r"torch\.load\(([^)]*)\)", code):
            assert "weights_only=True" in call.group(1), (path, call.group(0))
