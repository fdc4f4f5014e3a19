"""Faults during training: a real process killed with SIGKILL resumes with the losses of the uninterrupted
run (bitwise, fp32 on CPU); a damaged newest checkpoint is reported and the one before it used."""
import json
import os
import random
import subprocess
import sys

import pytest

from helpers.shards import small_shards
from helpers.processes import kill_after_a_save, saved_steps

import lmkit
from lmkit.cli import main
from lmkit.data.prepare import prepare

FLAGS = ["--preset", "tiny", "--batch-size", "8", "--seq-len", "32", "--save-every", "2", "--log-every", "1",
         "--precision", "fp32", "--seed", "5"]


@pytest.fixture(scope="module")
def data(tmp_path_factory, small_pydocs):
    return small_shards(tmp_path_factory.mktemp("faults"), small_pydocs, vocab_size=300)


def command(data, out, steps, *extra):
    return [sys.executable, "-m", "lmkit", "train", "--data", str(data / "data"), "--out", str(out),
            "--max-steps", str(steps), *FLAGS, *extra]


def logged(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r.get("val_loss")) for r in rows]


def test_sigkilled_run_resumes_with_the_uninterrupted_losses(data):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    straight = data / "straight"
    subprocess.run(command(data, straight, 16), check=True, capture_output=True, env=env, timeout=300)
    killed = data / "killed"
    rng = random.Random(0)
    kill_after_a_save(command(data, killed, 16), killed, 2, rng)
    first = max(saved_steps(killed))
    kill_after_a_save(command(data, killed, 16, "--resume"), killed, first + 2, rng)  # killed twice
    r = subprocess.run(command(data, killed, 16, "--resume"), capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert logged(killed) == logged(straight)  # every step's loss, bit for bit
    assert len(saved_steps(killed)) == 3 and not [p for p in (killed / "checkpoint").iterdir() if p.name.startswith(".")]
    assert (killed / "model.safetensors").read_bytes() == (straight / "model.safetensors").read_bytes()


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--data", str(data / "data"), "--out", str(out), "--max-steps", "6", *FLAGS]) == 0
    straight = logged(out)
    weights = out / "checkpoint" / "step-00000006" / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # one flipped bit pattern deep inside a tensor
    weights.write_bytes(bytes(blob))
    capsys.readouterr()
    assert main(["train", "--data", str(data / "data"), "--out", str(out), "--max-steps", "6", *FLAGS, "--resume"]) == 0
    err = capsys.readouterr().err
    assert "step-00000006 is damaged" in err and "sha256" in err and "using step-00000004" in err
    assert logged(out) == straight


def test_every_checkpoint_damaged_is_a_clear_error(data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--data", str(data / "data"), "--out", str(out), "--max-steps", "2", *FLAGS]) == 0
    (out / "checkpoint" / "step-00000002" / "state.json").write_text("{", encoding="utf-8")
    capsys.readouterr()
    assert main(["train", "--data", str(data / "data"), "--out", str(out), "--max-steps", "4", *FLAGS, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "every checkpoint" in err and "state.json" in err and "another --out" in err


def test_a_damaged_newer_save_is_pruned_not_the_fresh_one(data, tmp_path, capsys):
    # resumed from step 4 because step 6 is damaged, a save at step 5 (another cadence) with --keep-checkpoints 1
    # must keep step 5, not the damaged step 6 (that left no usable checkpoint at all)
    out = tmp_path / "run"
    assert main(["train", "--data", str(data / "data"), "--out", str(out), "--max-steps", "6", *FLAGS]) == 0
    (out / "checkpoint" / "step-00000006" / "state.json").write_text("{", encoding="utf-8")
    capsys.readouterr()
    assert main(["train", "--data", str(data / "data"), "--out", str(out), "--max-steps", "5", *FLAGS,
                 "--resume", "--save-every", "1", "--keep-checkpoints", "1"]) == 0
    assert "using step-00000004" in capsys.readouterr().err
    assert saved_steps(out) == [5]
    assert main(["train", "--data", str(data / "data"), "--out", str(out), "--max-steps", "6", *FLAGS, "--resume"]) == 0
    assert [s for s, _, _ in logged(out)] == [1, 2, 3, 4, 5, 6]


def test_keep_checkpoints_given_on_resume_is_honoured(data, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--data", str(data / "data"), "--out", str(out), "--max-steps", "6", *FLAGS]) == 0
    assert saved_steps(out) == [2, 4, 6]
    assert main(["train", "--data", str(data / "data"), "--out", str(out), "--max-steps", "8", *FLAGS,
                 "--resume", "--keep-checkpoints", "1"]) == 0
    assert saved_steps(out) == [8]


@pytest.mark.parametrize("where", ["checkpoint", "model folder"])
def test_disk_full_at_a_save_is_one_line_and_keeps_what_was_saved(data, tmp_path, capsys, monkeypatch, where):
    """A save that fails (disk full) used to end in a safetensors traceback; it is one line, leaves no
    temporary files, keeps the saves before it, and the run resumes with the losses of the uninterrupted run."""
    import errno

    from safetensors import SafetensorError

    from lmkit.models import CausalLM
    from lmkit.train import checkpoint

    straight, out = tmp_path / "straight", tmp_path / "full"
    assert main(["train", "--data", str(data / "data"), "--out", str(straight), "--max-steps", "6", *FLAGS]) == 0
    saves = []

    def disk_full_at_step_4(save):
        def wrapped(*args, **kwargs):
            saves.append(1)
            if len(saves) == 2:
                if where == "checkpoint":
                    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
                raise OSError(errno.ENOSPC, "No space left on device", str(args[-1]))
            return save(*args, **kwargs)
        return wrapped

    if where == "checkpoint":
        monkeypatch.setattr(checkpoint, "save_model", disk_full_at_step_4(checkpoint.save_model))
    else:
        monkeypatch.setattr(CausalLM, "save_pretrained", disk_full_at_step_4(CausalLM.save_pretrained))
    capsys.readouterr()
    assert main(["train", "--data", str(data / "data"), "--out", str(out), "--max-steps", "6", *FLAGS]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # the line after the progress bar
    assert err.startswith("lmkit: error: cannot write ") and "No space left on device" in err
    assert ("checkpoint step-00000004" if where == "checkpoint" else "checkpoint step-00000004 is saved") in err
    assert "--resume" in err
    assert saved_steps(out) == ([2] if where == "checkpoint" else [2, 4])
    assert not [p for p in out.rglob(".*")]  # no temporary folder or file stays
    monkeypatch.undo()
    assert main(["train", "--data", str(data / "data"), "--out", str(out), "--max-steps", "6", *FLAGS, "--resume"]) == 0
    assert logged(out) == logged(straight)


def test_resume_follows_the_shards_by_content_not_by_path(data, tmp_path, capsys):
    """The same shards in another folder resume exactly; shards of other documents (same tokenizer) are refused."""
    import shutil

    out = tmp_path / "run"
    assert main(["train", "--data", str(data / "data"), "--out", str(out), "--max-steps", "4", *FLAGS]) == 0
    straight = logged(out)
    shutil.rmtree(out / "checkpoint" / "step-00000004")
    moved = tmp_path / "moved"
    shutil.copytree(data / "data", moved)
    assert main(["train", "--data", str(moved), "--out", str(out), "--max-steps", "4", *FLAGS, "--resume"]) == 0
    assert logged(out) == straight
    lines = (data / "c.jsonl").read_text(encoding="utf-8").splitlines()
    (tmp_path / "fewer.jsonl").write_text("\n".join(lines[:-3]) + "\n", encoding="utf-8")
    prepare([str(tmp_path / "fewer.jsonl")], data / "tok.json", tmp_path / "other", workers=1, val_fraction=0.1)
    capsys.readouterr()
    assert main(["train", "--data", str(tmp_path / "other"), "--out", str(out), "--max-steps", "6", *FLAGS,
                 "--resume"]) == 2
    err = capsys.readouterr().err
    assert "is not what the run in" in err and "its documents differ" in err and "another --out" in err
