"""`lmkit serve` as a user runs it: a folder that cannot load is one line and exit 2 before any port opens; a ready
server prints its URL and model and logs each request; a port already in use is one line and exit 2."""
import re
import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")
from helpers.processes import process_env  # noqa: E402
from serving_folders import make_folder  # noqa: E402


def _serve(*args, **popen):
    return subprocess.Popen([sys.executable, "-m", "lmkit", "serve", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=process_env(), **popen)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("cli") / "tiny", "gpt2", n_positions=128)


@pytest.mark.parametrize("damage", ["truncated", "no_config"])
def test_a_folder_that_cannot_load_exits_2_with_one_line(folder, tmp_path, damage):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    if damage == "truncated":
        data = (broken / "model.safetensors").read_bytes()
        (broken / "model.safetensors").write_bytes(data[:len(data) // 2])
    else:
        (broken / "config.json").unlink()
    process = _serve("--model", broken, "--port", "0")
    out, err = process.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert process.returncode == 2 and len(lines) == 1 and not out, err
    assert ("truncated" if damage == "truncated" else "config.json is missing") in lines[0]


def test_ready_line_access_log_and_a_busy_port(folder):
    process = _serve("--model", folder, "--port", "0")
    try:
        ready = process.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:(\d+)/v1", ready)
        assert url and "128 positions" in ready and "'tiny'" in ready, ready
        port = url.group(1)
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                            timeout=60)
        assert answer.status_code == 200
        logged = process.stderr.readline()
        assert re.fullmatch(r'127\.0\.0\.1 "POST /v1/completions" 200 first \d+\.\d{3}s total \d+\.\d{3}s\n', logged)
        second = _serve("--model", folder, "--port", port)
        _, err = second.communicate(timeout=120)
        lines = err.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1 and f"port {port} on 127.0.0.1 is already in use" in lines[0]
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.parametrize("flags, message", [
    (("--cache-memory", "0.00001"), "cannot hold one request"),
    (("--lora", "no-equals-sign"), "give NAME=ADAPTER_DIR"),
    (("--lora", "x=/nonexistent/adapter"), "is not a folder"),
])
def test_a_cache_too_small_or_a_bad_adapter_exits_2_with_one_line(folder, flags, message):
    process = _serve("--model", folder, "--port", "0", *flags)
    out, err = process.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert process.returncode == 2 and len(lines) == 1 and not out, err
    assert message in lines[0]


@pytest.mark.bf16
def test_dtype_bf16_serves_what_the_bf16_model_generates(folder):
    import torch

    import lmkit

    process = _serve("--model", folder, "--port", "0", "--dtype", "bf16", "--quiet")
    try:
        ready = process.stdout.readline()
        assert "bf16" in ready, ready
        port = re.search(r"http://127\.0\.0\.1:(\d+)/v1", ready).group(1)
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                            json={"prompt": "hello world", "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    finally:
        process.terminate()
        process.communicate(timeout=60)
    model, tok = lmkit.load_model(folder, dtype=torch.bfloat16), lmkit.load_tokenizer(folder)
    ids = tok.encode("hello world")
    expected = model.generate(torch.tensor([ids]), max_new_tokens=12, eos_token_id=[])[0, len(ids):].tolist()
    assert answer.json()["choices"][0]["text"] == tok.decode(expected, skip_special_tokens=True)


@pytest.mark.bf16
def test_dtype_auto_follows_trainings_precision_rule():
    import torch

    from lmkit.cli.serve import _dtype
    from lmkit.train.precision import default_precision

    assert _dtype("auto", "cpu") == (torch.bfloat16 if default_precision("cpu") == "bf16" else None)
    assert _dtype("fp32", "cpu") is None and _dtype("bf16", "cpu") is torch.bfloat16


def test_the_engine_runs_in_a_child_process_unless_engine_thread_is_given():
    from lmkit.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--model", "m"]).engine == "process"
    assert parser.parse_args(["serve", "--model", "m", "--engine-process"]).engine == "process"
    assert parser.parse_args(["serve", "--model", "m", "--engine-thread"]).engine == "thread"
    with pytest.raises(SystemExit):  # one or the other
        parser.parse_args(["serve", "--model", "m", "--engine-thread", "--engine-process"])
