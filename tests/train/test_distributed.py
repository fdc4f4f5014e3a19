"""`torchrun --nproc-per-node 2 -m lmkit train` on the CPU (gloo) logs the losses one process logs."""
import json
import subprocess
import sys

import pytest

import lmkit
from helpers.shards import small_shards
from helpers.processes import process_env

FLAGS = ["--preset", "tiny", "--max-steps", "4", "--batch-size", "8", "--seq-len", "32", "--save-every", "2",
         "--warmup-steps", "10",  # runs of 2 and 4 steps share their schedule: still warming up
         "--log-every", "1", "--precision", "fp32", "--seed", "3"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory, small_pydocs):
    return small_shards(tmp_path_factory.mktemp("dist"), small_pydocs)


def run_train(out, data, nproc, *extra):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 \
        else [sys.executable]
    cmd = launcher + ["-m", "lmkit", "train", "--data", str(data), "--out", str(out), *FLAGS, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env=process_env(), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    if "--fsdp" in extra and nproc > 1:
        assert "(FSDP, gloo)" in r.stdout
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one(shards):
    return run_train(shards / "one", shards / "data", 1)


def test_two_gloo_processes_log_the_losses_of_one(shards, one):
    # 2 ranks x 4 rows, each rank accumulating 2 micro batches of 2 rows: the same global batch of 8
    two = run_train(shards / "two", shards / "data", 2, "--micro-batch-size", "4")
    assert [r["step"] for r in two] == [1, 2, 3, 4]  # rank 0 alone writes: one line per step
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) < 1e-5
        assert (a.get("val_loss") is None) == (b.get("val_loss") is None)
        if a.get("val_loss") is not None:
            assert abs(a["val_loss"] - b["val_loss"]) < 1e-5
    state = json.loads(next((shards / "two" / "checkpoint").glob("step-00000004/state.json")).read_text())
    assert state["world_size"] == 2 and len(state["rng_ranks"]) == 2  # every rank's RNG state is kept
    assert lmkit.load_model(shards / "two").config.vocab_size == 320


@pytest.mark.slow
def test_fsdp_logs_the_losses_of_one_process_and_resumes_exactly(shards, one):
    two = run_train(shards / "fsdp", shards / "data", 2, "--fsdp")
    assert all(abs(a["loss"] - b["loss"]) < 1e-5 for a, b in zip(one, two)) and len(two) == 4
    import shutil

    shutil.rmtree(shards / "fsdp" / "checkpoint" / "step-00000004")  # back to the save of step 2
    resumed = run_train(shards / "fsdp", shards / "data", 2, "--resume")  # stays FSDP without the flag
    assert [(r["step"], r["loss"], r.get("val_loss")) for r in resumed] == \
           [(r["step"], r["loss"], r.get("val_loss")) for r in two]
    assert _state(shards / "fsdp", 4)["train_config"]["fsdp"] is True
    # one process resumes an FSDP run (its gathered tied weights were saved twice, and one process refused them)
    shutil.rmtree(shards / "fsdp" / "checkpoint" / "step-00000004")
    alone = run_train(shards / "fsdp", shards / "data", 1, "--resume")
    assert all(abs(a["loss"] - b["loss"]) < 1e-5 for a, b in zip(one, alone)) and len(alone) == 4


def _state(out, step):
    return json.loads((out / "checkpoint" / f"step-{step:08d}" / "state.json").read_text())


def test_fsdp_given_on_resume_shards_a_ddp_run(shards, one, tmp_path):
    """--fsdp on --resume used to be ignored silently (the run went on as DDP)."""
    run_train(tmp_path / "ddp", shards / "data", 2, "--max-steps", "2")
    assert _state(tmp_path / "ddp", 2)["train_config"]["fsdp"] is False
    resumed = run_train(tmp_path / "ddp", shards / "data", 2, "--fsdp", "--resume")
    assert _state(tmp_path / "ddp", 4)["train_config"]["fsdp"] is True
    assert all(abs(a["loss"] - b["loss"]) < 1e-5 for a, b in zip(one, resumed)) and len(resumed) == 4


def test_a_batch_that_does_not_divide_among_the_processes(shards, tmp_path):
    out = tmp_path / "odd"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "lmkit", "train",
           "--data", str(shards / "data"), "--out", str(out), *FLAGS, "--batch-size", "7"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=process_env(), timeout=300)
    assert r.returncode != 0 and not out.exists()
    assert "lmkit: error: --batch-size 7 does not divide among the 2 processes; pick a multiple of 2" in r.stderr
    assert r.stderr.count("lmkit: error:") == 1  # rank 0 reports it; rank 1, which hit the same, exits quietly


def test_resume_on_another_world_size_gives_each_rank_its_own_rng(shards, one, tmp_path):
    """A one-process run resumed by 2 processes: rank 0 goes on from the saved RNG state, rank 1 draws from its own
    (it took rank 0's as well, and so would drop the same units in its other rows)."""
    import shutil

    shutil.copytree(shards / "one", tmp_path / "r")
    shutil.rmtree(tmp_path / "r" / "checkpoint" / "step-00000004")  # back to the save of step 2
    resumed = run_train(tmp_path / "r", shards / "data", 2, "--resume")
    assert len(resumed) == 4 and all(abs(a["loss"] - b["loss"]) < 1e-5 for a, b in zip(one, resumed))
    rngs = _state(tmp_path / "r", 4)["rng_ranks"]
    assert len(rngs) == 2 and rngs[0]["torch"] != rngs[1]["torch"]


@pytest.mark.slow
def test_muon_under_ddp_and_fsdp_logs_the_losses_of_one_process(shards, one):
    """Muon orthogonalizes whole matrices: under FSDP each rank gathers its shards first (train/muon.py)."""
    alone = run_train(shards / "muon1", shards / "data", 1, "--optimizer", "muon")
    assert abs(alone[-1]["loss"] - one[-1]["loss"]) > 1e-3  # not AdamW's run
    for name, extra in (("muon-ddp", ()), ("muon-fsdp", ("--fsdp",))):
        two = run_train(shards / name, shards / "data", 2, "--optimizer", "muon", *extra)
        assert len(two) == 4 and all(abs(a["loss"] - b["loss"]) < 1e-5 for a, b in zip(alone, two)), name


def test_rank_1_reports_its_own_errors_while_training(monkeypatch):
    """An error while training may be rank 1's alone (its file system, its memory): rank 1 raises it, so it is
    printed (set-up errors are agreed on by every rank first: see the next test)."""
    import argparse
    import contextlib

    from lmkit.cli import train as cli_train
    from lmkit.errors import TrainingError
    from lmkit.train import distributed

    class FakeTrainer:
        cfg = None

        def __init__(self, cfg, **kw):
            pass

        def fit(self):
            raise TrainingError("rank 1's own trouble")

    monkeypatch.setattr(distributed, "setup", lambda device=None: distributed.DistContext(rank=1, world_size=2))
    monkeypatch.setattr(distributed, "agree_on_setup", lambda ctx: contextlib.nullcontext())  # no group here
    monkeypatch.setattr(cli_train, "config_from_args", lambda args: (argparse.Namespace(out="run"), set()))
    monkeypatch.setattr(cli_train, "Trainer", FakeTrainer)
    with pytest.raises(TrainingError, match="rank 1's own trouble"):
        cli_train.run(argparse.Namespace())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_setup_error_on_rank_1_alone_stops_every_rank(corpus_file, tmp_path):
    """Two gloo processes on "nodes" that do not share a file system: the corpus path exists for rank 0 only. Rank 1
    failed alone and exited 2 silently, and rank 0 went on into the next collective, waiting for the group's
    timeout (30 minutes). Now every rank learns it after set-up: both exit 2, rank 0 prints rank 1's message once,
    with its rank, and nothing is written."""
    import shutil

    port = _free_port()
    procs = []
    for rank in (0, 1):
        node = tmp_path / f"node{rank}"
        node.mkdir()
        if rank == 0:
            shutil.copy(corpus_file, node / "corpus.jsonl")
        env = {**process_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        cmd = [sys.executable, "-m", "lmkit", "train", "--preset", "tiny", "--corpus", "corpus.jsonl", "--out", "run",
               "--max-steps", "2", "--batch-size", "4", "--seq-len", "32", "--precision", "fp32"]
        procs.append(subprocess.Popen(cmd, cwd=node, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=240) for p in procs]  # a hang (the bug) ends here, not after 30 minutes
    finally:
        for p in procs:
            p.kill()
    (_, err0), (_, err1) = outs
    assert [p.returncode for p in procs] == [2, 2], err0[-3000:] + err1[-3000:]
    assert err0.count("lmkit: error:") == 1 and "lmkit: error:" not in err1
    line = next(l for l in err0.splitlines() if l.startswith("lmkit: error:"))
    assert line.startswith("lmkit: error: rank 1: ") and "corpus.jsonl" in line, line
    assert not (tmp_path / "node0" / "run").exists() and not (tmp_path / "node1" / "run").exists()


def test_failure_report_names_the_ranks_unless_all_gave_the_same():
    from lmkit.train.distributed import failure_report

    assert failure_report(["bad flag", "bad flag"]) == "bad flag"  # a flag that fails everywhere: once, as it is
    assert failure_report([None, "no corpus"]) == "rank 1: no corpus"
    assert failure_report(["a", "b", None]) == "rank 0: a; rank 1: b"
    assert failure_report([None, "x", "x", "y"]) == "ranks 1, 2: x; rank 3: y"


NESTED = """
import time
from lmkit.train import distributed as D
ctx = D.setup()
try:
    with D.agree_on_setup(ctx):  # lmkit train's: around the flags and Trainer, whose set-up agrees on its own
        with D.agree_on_setup(ctx):
            if ctx.rank == 1:
                raise ValueError("a bug on rank 1")
except Exception as exc:
    print(f"rank {ctx.rank}: {type(exc).__name__}: {exc}", flush=True)
if ctx.rank == 0:
    time.sleep(2)  # rank 0 goes on and leaves the group
D.teardown(ctx, False)
"""


def test_a_bug_agreed_on_in_a_nested_setup_keeps_its_own_exception():
    """A bug on rank 1 inside Trainer's set-up (nested in lmkit train's): the inner block agrees on it and rank 1
    re-raises it; the outer block agreed a second time on that rank alone, so rank 1 waited in an all_reduce that
    rank 0 never joined and ended with gloo's 'Connection closed by peer' instead of its own ValueError."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", NESTED], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**process_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for rank in (0, 1)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert outs[0].strip() == "rank 0: SetupFailed: rank 1: ValueError: a bug on rank 1 (a bug: see that rank's traceback)"
    assert outs[1].strip() == "rank 1: ValueError: a bug on rank 1"
