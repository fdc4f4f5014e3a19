"""--device and device=: what resolves where, the one-line refusals, and the CPU half of running on a device
(the GPU half is tests/gpu/)."""
import argparse

import pytest
import torch

import lmkit
from lmkit.cli import build_parser
from lmkit.device import DeviceError, module_device, resolve_device
from lmkit.models import build_model
from lmkit.train.precision import bf16_supported, default_precision
from helpers.faults import fails

# every command (and action) that runs a model; quantize (int8 kernels: CPU only) and word2vec (numba) do not
RUNS_A_MODEL = ["train", "finetune", "generate", "eval", "chat", "serve", "harness", "rag index", "rag query",
                "rag ask", "distill", "lens", "plot attention", "plot embeddings", "plot lens", "prune", "search"]
NO_GPU = not torch.cuda.is_available()


def _mps() -> bool:
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def test_auto_picks_cuda_then_mps_then_cpu():
    want = "cuda" if torch.cuda.is_available() else "mps" if _mps() else "cpu"
    assert resolve_device("auto").type == want
    assert resolve_device(None) == resolve_device("auto")
    cpu = torch.device("cpu")
    assert resolve_device("cpu") == resolve_device(" CPU ") == resolve_device(cpu) == cpu


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:x", "cuda:-1", "cpu:0", "mps:1", "auto:0", "", "cuda0"])
def test_malformed_names_are_refused_with_the_choices(spec):
    with pytest.raises(DeviceError, match=r"not a device name; use one of auto\|cpu\|cuda\[:N\]\|mps"):
        resolve_device(spec)


@pytest.mark.skipif(not NO_GPU, reason="this machine has CUDA")
def test_cuda_without_a_gpu_says_what_to_use():
    for spec in ("cuda", "cuda:1"):
        with pytest.raises(DeviceError) as err:
            resolve_device(spec)
        assert str(err.value) == (f"--device {spec}: no CUDA device is visible (torch.cuda.is_available() is False); "
                                  "use --device cpu or auto")


def test_cuda_index_past_the_gpus_and_torchrun_ranks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cuda") == resolve_device("auto") == torch.device("cuda", 0)
    with pytest.raises(DeviceError, match=r"--device cuda:2: this machine has 2 CUDA devices \(cuda:0..cuda:1\)"):
        resolve_device("cuda:2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("cuda") == resolve_device("auto") == torch.device("cuda", 1)  # this rank's own GPU
    assert resolve_device("cuda:0") == torch.device("cuda", 0)  # named explicitly: as given


def test_default_precision_follows_the_device(monkeypatch):
    assert default_precision() == default_precision("cpu") == ("bf16" if bf16_supported() else "fp32")
    assert default_precision("mps") == "fp32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for supported, want in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: supported)
        assert default_precision(torch.device("cuda", 0)) == want


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny")
    build_model(lmkit.get_preset("tiny")).save_pretrained(folder)
    return folder


def test_load_model_device_cpu_and_auto(tiny_folder):
    plain = lmkit.load_model(tiny_folder)
    ids = torch.tensor([[1, 5, 9, 2]])
    for spec in ("cpu", torch.device("cpu"), "auto"):
        model = lmkit.load_model(tiny_folder, device=spec)
        assert module_device(model) == resolve_device(spec) and not model.training
        torch.testing.assert_close(model(ids.to(model.device)).logits.cpu(), plain(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not NO_GPU, reason="this machine has CUDA")
def test_load_model_on_a_missing_gpu_is_refused(tiny_folder):
    with pytest.raises(DeviceError, match=r"^device=cuda: no CUDA device is visible .* use device=cpu or auto$"):
        lmkit.load_model(tiny_folder, device="cuda")


def test_module_device_of_a_module_without_weights():
    assert module_device(torch.nn.ReLU()) == torch.device("cpu")


def _leaves(parser, path=()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield " ".join(path), parser
        return
    for name, sub in subs[0].choices.items():
        yield from _leaves(sub, (*path, name))


LEAVES = dict(_leaves(build_parser()))


def test_every_command_that_runs_a_model_takes_device():
    with_device = {name for name, p in LEAVES.items() if any("--device" in a.option_strings for a in p._actions)}
    assert with_device == set(RUNS_A_MODEL)
    for name in RUNS_A_MODEL:
        action = next(a for a in LEAVES[name]._actions if "--device" in a.option_strings)
        assert action.default == "auto" and "auto" in action.help, name


def _argv(name: str, device: str) -> list[str]:
    """The command with its required flags filled by placeholders (the device is refused before they are read)."""
    argv, parser = name.split(), LEAVES[name]
    one_of = [group._group_actions[0] for group in parser._mutually_exclusive_groups if group.required]
    for action in parser._actions:
        if (action.required or action in one_of) and action.option_strings:
            argv += [action.option_strings[0], "1" if action.type in (int, float) else "placeholder"]
    return argv + ["--device", device]


@pytest.mark.parametrize("name", RUNS_A_MODEL)
def test_a_bad_device_is_one_line_and_exit_2_for_every_command(name, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing any command might write lands in the repository
    fails(capsys, _argv(name, "gpu0"), "--device gpu0: not a device name")
    if NO_GPU:
        fails(capsys, _argv(name, "cuda"), "--device cuda: no CUDA device is visible", "use --device cpu or auto")
    assert list(tmp_path.iterdir()) == []


def test_generate_with_device_cpu_and_auto_match_the_default(tiny_folder, capsys):
    from helpers.hf_folders import byte_level_bpe

    byte_level_bpe(["<|endoftext|>"]).save(str(tiny_folder / "tokenizer.json"))
    outputs = []
    for extra in ([], ["--device", "cpu"], ["--device", "auto"]):
        assert lmkit.cli.main(["generate", "--model", str(tiny_folder), "--prompt", "def f(x):",
                               "--max-new-tokens", "8", *extra]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] == outputs[2] and outputs[0].startswith("def f(x):")


def test_the_api_objects_take_device(tiny_folder, minilm_path):
    from lmkit.generation.engine import Engine

    model = lmkit.load_model(tiny_folder)
    assert Engine(model, max_batch=2, device="cpu").device == torch.device("cpu")
    plain = lmkit.SentenceEncoder.from_pretrained(minilm_path)
    placed = lmkit.SentenceEncoder.from_pretrained(minilm_path, device="auto")
    assert module_device(placed.model) == resolve_device("auto")
    sentences = ["A man is eating food.", "def f(x): return x"]
    assert abs(placed.encode(sentences) - plain.encode(sentences)).max() < 1e-5
    if NO_GPU:  # a device that is not there is refused where it is named, before any weight moves
        with pytest.raises(DeviceError, match="^device=cuda:0: no CUDA device"):
            Engine(model, device="cuda:0")
        with pytest.raises(DeviceError, match="^device=cuda: no CUDA device"):
            lmkit.SentenceEncoder.from_pretrained(minilm_path, device="cuda")
        assert module_device(model) == torch.device("cpu")


def test_an_int8_folder_is_refused_on_a_gpu(tiny_folder, tmp_path, monkeypatch):
    from lmkit.compress import quantize_dynamic_int8
    from lmkit.errors import ConfigError

    quantize_dynamic_int8(lmkit.load_model(tiny_folder)).save_pretrained(tmp_path)
    assert module_device(lmkit.load_model(tmp_path, device="cpu")) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"int8 layers run on the CPU only; load it with device='cpu'"):
        lmkit.load_model(tmp_path, device="cuda")
