"""bf16 on CPUs with and without native bf16: the switch that emulates the second, and the defaults that follow."""
import json
import os
import subprocess
import sys

import pytest
import torch

from lmkit.train.config import TrainConfig, bf16_supported, default_precision
from lmkit.train.muon import newton_schulz_dtype

PROBE = ("import json, torch; from lmkit.train.config import TrainConfig, bf16_supported; "
         "from lmkit.train.muon import newton_schulz_dtype; "
         "print(json.dumps([bf16_supported(), TrainConfig().resolved().precision, str(newton_schulz_dtype())]))")


def _probe(**env) -> list:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.bf16
def test_defaults_follow_whether_bf16_is_native():
    native = bf16_supported()
    assert default_precision() == ("bf16" if native else "fp32")
    assert TrainConfig().resolved().precision == default_precision()
    assert TrainConfig(precision="bf16").resolved().precision == "bf16"  # asked for: kept on any CPU
    assert newton_schulz_dtype() == (torch.bfloat16 if native else torch.float32)


@pytest.mark.bf16
def test_onednn_max_cpu_isa_avx2_turns_bf16_off():
    """ONEDNN_MAX_CPU_ISA=AVX2 is the switch that makes this CPU one without native bf16 for lmkit's defaults."""
    assert _probe(ONEDNN_MAX_CPU_ISA="AVX2") == [False, "fp32", "torch.float32"]
    if os.environ.get("ONEDNN_MAX_CPU_ISA") is None and bf16_supported():  # a native-bf16 CPU left as it is
        assert _probe() == [True, "bf16", "torch.bfloat16"]


def test_fine_tuning_defaults_to_bf16_only_where_it_is_faster(monkeypatch):
    """fast_precision (the fine-tuning jobs' default) is default_precision, but fp32 on a CPU whose native bf16 is no
    faster than fp32: Intel's AVX512-BF16 without AMX."""
    from lmkit.finetune.common import check_run
    from lmkit.train import precision as P

    assert check_run(None, False, None, None, "cosine") == P.fast_precision()
    assert check_run(None, False, None, "bf16", "cosine") == "bf16"  # asked for: kept on any CPU
    assert P.fast_precision() == ("bf16" if P.bf16_faster() else "fp32")
    assert not P.bf16_faster() or P.bf16_supported()
    for native, amx, vendor, want in ((False, False, "AuthenticAMD", False), (True, True, "GenuineIntel", True),
                                      (True, False, "GenuineIntel", False), (True, False, "AuthenticAMD", True)):
        monkeypatch.setattr(P, "bf16_supported", lambda: native)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(P, "cpu_vendor", lambda: vendor)
        assert P.bf16_faster.__wrapped__() is want
        monkeypatch.setattr(P, "bf16_faster", lambda: want)
        assert P.fast_precision() == P.fast_precision("cpu") == ("bf16" if want else "fp32")
        assert P.fast_precision("mps") == "fp32"
        monkeypatch.undo()


def _bench_machine():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "machine.py"
    spec = importlib.util.spec_from_file_location("bench_machine", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.bf16
def test_benchmarks_name_the_cpu_and_skip_bf16_rows_where_bf16_is_emulated(monkeypatch):
    machine = _bench_machine()
    monkeypatch.delenv("LMKIT_BENCH_BF16", raising=False)
    monkeypatch.setattr(machine, "bf16_native", lambda: False)
    assert not machine.run_bf16()
    line = machine.describe(["fp32"])
    assert machine.cpu_name() in line and "bf16 emulated" in line and "precisions run: fp32" in line
    assert "not native" in machine.skipped_line("bf16 rows")
    monkeypatch.setenv("LMKIT_BENCH_BF16", "1")  # asked for: run anyway
    assert machine.run_bf16()
    monkeypatch.setattr(machine, "bf16_native", lambda: True)
    monkeypatch.delenv("LMKIT_BENCH_BF16")
    assert machine.run_bf16() and "bf16 native" in machine.describe(["fp32", "bf16"])
