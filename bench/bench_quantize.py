"""Dynamic int8 quantization of the base model's linear layers on CPU: weight size, forward
throughput and validation loss against float32.   python bench/bench_quantize.py"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402
import compress_setup as setup  # noqa: E402

from lmkit.compress.recipes import quantize_report  # noqa: E402


def main() -> None:
    folder = setup.base_model()
    r = quantize_report(folder, ["pydocs"], setup.SEQ_LEN, max_val_docs=60)
    rows = [{"name": k, "mb": f"{v['bytes'] / 1e6:.2f}", "tps": f"{v['tokens_per_s']:.0f}", "loss": f"{v['loss']:.4f}",
             "acc": f"{v['accuracy']:.4f}"} for k, v in r.items()]
    print(machine.describe(["fp32", "int8"]))
    print(setup.table(rows, [("name", "weights"), ("mb", "size (MB)"), ("tps", "forward tokens/s"),
                             ("loss", "val loss"), ("acc", "next-token acc.")]))
    f, q = r["fp32"], r["int8"]
    print(f"\nsize x{q['bytes'] / f['bytes']:.2f}, speed x{q['tokens_per_s'] / f['tokens_per_s']:.2f}, "
          f"loss {q['loss'] - f['loss']:+.4f} nats/token")


if __name__ == "__main__":
    import argparse

    # no options; --help describes the run instead of starting it
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
