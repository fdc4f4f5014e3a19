"""`lmkit finetune --task clm --rope-scaling`: the extended window trains and transformers reads the same model."""
import json
import shutil

import pytest
import torch
import transformers

import lmkit
from helpers.hf_folders import build, cli
from helpers.hub_pairs import randomized
from lmkit.finetune.context import rope_extension


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny LLaMA folder (64 positions) with larger random weights, so a RoPE mismatch shows in the logits."""
    folder = tmp_path_factory.mktemp("llama")
    build("llama", folder)
    randomized(transformers.AutoModelForCausalLM.from_pretrained(folder)).save_pretrained(folder)
    return folder


def _config_style(folder, style: str) -> None:
    """Rewrite config.json with RoPE in transformers 4.x keys (rope_theta, rope_scaling) or 5.x (rope_parameters)."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    scaling = cfg.pop("rope_scaling", None)
    params = cfg.pop("rope_parameters", None) or {"rope_type": "default", **(scaling or {}),
                                                  "rope_theta": cfg.get("rope_theta", 1e4)}
    cfg.pop("rope_theta", None)
    if style == "v4":
        cfg["rope_theta"] = params.pop("rope_theta")
        if params.get("rope_type") != "default":
            cfg["rope_scaling"] = scaling or params
    else:
        cfg["rope_parameters"] = params
    path.write_text(json.dumps(cfg))


def _logits_pair(folder, ids):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return hf(ids).logits, lmkit.load_model(folder).eval()(ids).logits


@pytest.mark.parametrize("kind, style", [("linear", "v4"), ("dynamic", "v5"), ("yarn", "v4"), ("yarn", "v5")])
def test_extended_window_trains_and_transformers_reads_the_same_model(llama, tmp_path, capfd, kind, style):
    src = tmp_path / "in"
    shutil.copytree(llama, src)
    _config_style(src, style)
    out = tmp_path / "out"
    rc, printed, err = cli(capfd, "finetune", "--task", "clm", "--model", str(src), "--train", "pydocs", "--out",
                           str(out), "--seq-len", "96", "--rope-scaling", kind, "--rope-factor", "2.5", "--max-steps",
                           "2", "--batch-size", "2", "--precision", "fp32")
    assert rc == 0, err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_scaling"]["rope_type"] == cfg["rope_parameters"]["rope_type"] == kind
    assert cfg["rope_scaling"]["factor"] == 2.5
    # dynamic NTK grows its base only past max_position_embeddings, so that stays the trained 64
    assert cfg["max_position_embeddings"] == (64 if kind == "dynamic" else 96)
    if kind == "yarn":
        assert cfg["rope_scaling"]["original_max_position_embeddings"] == 64
    assert json.loads((out / "finetune.json").read_text())["rope_scaling"]["rope_type"] == kind
    ids = torch.randint(3, 300, (2, 150), generator=torch.Generator().manual_seed(0))  # past every window
    ref, ours = _logits_pair(out, ids)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    # the rotation changed: the unscaled model reads these positions otherwise
    plain = lmkit.load_model(src).eval()
    with torch.no_grad():
        assert (plain(ids).logits - ref).abs().max() > 1e-2
    for other in ("v4", "v5"):  # transformers reads the same RoPE from either spelling of the saved config
        _config_style(out, other)
        torch.testing.assert_close(_logits_pair(out, ids)[0], ref, rtol=1e-5, atol=1e-5)


def test_defaults_fill_the_factor_or_the_length():
    cfg = lmkit.config.ModelConfig(position="rope", max_seq_len=64, vocab_size=50, d_model=16, n_layers=1, n_heads=2)
    assert rope_extension(cfg, "linear", None, 256) == (256, 256, {"rope_type": "linear", "factor": 4.0})
    assert rope_extension(cfg, "yarn", 3.0, None) == (192, 192, {"rope_type": "yarn", "factor": 3.0,
                                                                 "original_max_position_embeddings": 64})
    assert rope_extension(cfg, "dynamic", 2.0, None) == (128, 64, {"rope_type": "dynamic", "factor": 2.0})


@pytest.mark.parametrize("flags, match", [
    (["--rope-scaling", "linear", "--rope-factor", "0.5"], "--rope-factor must be at least 1"),
    (["--rope-scaling", "yarn"], "needs --rope-factor F or --seq-len N"),
    (["--rope-factor", "2"], "--rope-factor needs --rope-scaling"),
    (["--rope-scaling", "linear", "--rope-factor", "2", "--seq-len", "0"], "--seq-len must be at least 1"),
])
def test_bad_extension_flags_are_one_line(llama, tmp_path, capfd, flags, match):
    rc, _, err = cli(capfd, "finetune", "--task", "clm", "--model", str(llama), "--train", "pydocs", "--out",
                     str(tmp_path / "o"), "--max-steps", "1", *flags)
    assert rc == 2 and match in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_refuses_a_model_it_cannot_extend(llama, tmp_path, capfd):
    gpt2 = build("gpt2", tmp_path / "gpt2")
    rc, _, err = cli(capfd, "finetune", "--task", "clm", "--model", gpt2, "--train", "pydocs", "--out",
                     str(tmp_path / "o"), "--rope-scaling", "linear", "--rope-factor", "2")
    assert rc == 2 and "extends a RoPE model's window" in err
    scaled = tmp_path / "scaled"
    shutil.copytree(llama, scaled)
    cfg = json.loads((scaled / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    (scaled / "config.json").write_text(json.dumps(cfg))
    rc, _, err = cli(capfd, "finetune", "--task", "clm", "--model", str(scaled), "--train", "pydocs", "--out",
                     str(tmp_path / "o"), "--rope-scaling", "yarn", "--rope-factor", "2")
    assert rc == 2 and "already scaled (linear)" in err
    rc, _, err = cli(capfd, "finetune", "--task", "sft", "--model", str(llama), "--train", "pydocs-instruct", "--out",
                     str(tmp_path / "o"), "--rope-scaling", "yarn", "--rope-factor", "2")
    assert rc == 2 and "applies to --task clm only" in err


def test_longlora_trains_lora_embeddings_and_norms_and_saves_a_plain_adapter(llama, tmp_path, capfd):
    import peft

    from lmkit.peft import load_adapter

    out = tmp_path / "out"
    rc, _, err = cli(capfd, "finetune", "--task", "clm", "--model", str(llama), "--train", "pydocs", "--out", str(out),
                     "--peft", "lora", "--longlora", "--seq-len", "64", "--s2-group", "16", "--max-steps", "2",
                     "--batch-size", "2", "--precision", "fp32")
    assert rc == 0, err
    assert json.loads((out / "finetune.json").read_text())["longlora"] == {"s2_group": 16}
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert {"embed_tokens", "norm"} <= set(adapter["modules_to_save"])
    assert "s2" not in (out / "adapter_config.json").read_text().lower()
    base = lmkit.load_model(llama)
    tuned = load_adapter(lmkit.load_model(llama), out).eval()
    emb = tuned.base_model.decoder.embeddings.tokens
    assert not torch.equal(emb.weight, base.decoder.embeddings.tokens.weight)  # the embeddings trained in full
    # PEFT reads the adapter onto the transformers model: the same logits, so inference attends in full
    hf = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(llama), out).eval()
    ids = torch.randint(3, 300, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(tuned(ids).logits, hf(ids).logits, rtol=1e-4, atol=1e-4)


def test_longlora_with_a_longer_window_saves_the_merged_model(llama, tmp_path, capfd):
    out = tmp_path / "out"
    rc, _, err = cli(capfd, "finetune", "--task", "clm", "--model", str(llama), "--train", "pydocs", "--out", str(out),
                     "--peft", "lora", "--longlora", "--rope-scaling", "yarn", "--rope-factor", "2", "--max-steps", "1",
                     "--batch-size", "2", "--precision", "fp32")
    assert rc == 0, err
    assert json.loads((out / "finetune.json").read_text())["longlora"] == {"s2_group": 32}
    ids = torch.randint(3, 300, (1, 128), generator=torch.Generator().manual_seed(2))
    ref, ours = _logits_pair(out, ids)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    rc, _, err = cli(capfd, "finetune", "--task", "clm", "--model", str(llama), "--train", "pydocs", "--out",
                     str(tmp_path / "o2"), "--peft", "lora", "--longlora", "--seq-len", "60", "--s2-group", "16")
    assert rc == 2 and "multiple of 16" in err
    rc, _, err = cli(capfd, "finetune", "--task", "clm", "--model", str(llama), "--train", "pydocs", "--out",
                     str(tmp_path / "o2"), "--peft", "ia3", "--longlora")
    assert rc == 2 and "use --peft lora or full" in err
