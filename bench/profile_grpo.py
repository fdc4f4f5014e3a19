"""Where a GRPO step's CPU time goes, lmkit's job and TRL's GRPOTrainer side by side, at bench_grpo.py's settings.

Each phase's process CPU time is summed by wrapping the function that does it (a few calls a step, so the
wrappers cost nothing measurable): the rollouts (lmkit: `GRPOJob.rollouts`, the Engine; TRL: transformers'
`generate`), the rewards, the log-probability forwards without gradients (the reference model's, and the old
policy's where one is taken), the policy's forward with the loss, the backward, the optimizer step (clipping
included), and the rest of the step (collation, metrics, the trainer's own work). `--cprofile` then prints the
functions of lmkit's rollouts that take the most time of their own, and `--ops` torch.profiler's operator table of
one rollout on each side.

    nice -n 19 python bench/profile_grpo.py [bench_grpo.py's flags] [--cprofile] [--ops]
"""
from __future__ import annotations

import cProfile
import collections
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_grpo  # noqa: E402

PHASES = ("rollouts", "rewards", "no-grad logps", "loss forward", "backward", "optimizer", "rest")


class Phases:
    """Process CPU seconds per phase, and the steps' totals."""

    def __init__(self):
        self.seconds = collections.Counter()
        self.depth = 0
        self.rollouts = 0

    def wrap(self, owner, name: str, phase, outer_only: bool = True) -> None:
        """Time owner.name into `phase` (a name, or a function of the call's arguments giving one)."""
        original = getattr(owner, name)
        phases = self

        def timed(*args, **kwargs):
            if outer_only and phases.depth:
                return original(*args, **kwargs)
            label = phase(*args, **kwargs) if callable(phase) else phase
            if label == "rollouts":  # a step's first phase: the first step (warm-up) is left out, as the bench does
                phases.rollouts += 1
                if phases.rollouts == 2:
                    phases.seconds.clear()
            phases.depth += 1
            t = time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                phases.seconds[label] += time.process_time() - t
                phases.depth -= 1

        setattr(owner, name, timed)
        return original

    def optimizer_hooks(self) -> None:
        from torch.optim import optimizer as optimizer_module

        start = {}

        def pre(opt, args, kwargs):
            start["t"] = time.process_time()

        def post(opt, args, kwargs):
            self.seconds["optimizer"] += time.process_time() - start["t"]

        optimizer_module.register_optimizer_step_pre_hook(pre)
        optimizer_module.register_optimizer_step_post_hook(post)

    def table(self, name: str, step_times: list[float]) -> None:
        step_times = step_times[1:]
        steps = len(step_times)
        total = sum(step_times)
        known = sum(self.seconds[p] for p in PHASES if p != "rest")
        self.seconds["rest"] = total - known
        print(f"{name}: steps 2..{steps + 1}, {total / steps:.3f} s CPU a step")
        for p in PHASES:
            print(f"  {p:<14} {self.seconds[p] / steps:7.3f} s  {100 * self.seconds[p] / total:5.1f}%")


def lmkit_side(folder: Path, a, tmp: Path, phases: Phases) -> None:
    from lmkit.finetune import grpo, grpo_loss

    phases.wrap(grpo.GRPOJob, "rollouts", "rollouts")
    phases.wrap(grpo.GRPOJob, "rewards", "rewards")
    phases.wrap(grpo, "completion_logps", "no-grad logps")
    phases.wrap(grpo_loss.GRPOObjective, "loss", "loss forward")
    original = phases.wrap(torch.Tensor, "backward", "backward")
    times = bench_grpo.lmkit_steps(folder, a, tmp)
    torch.Tensor.backward = original
    phases.table("lmkit", times)


def trl_side(folder: Path, a, tmp: Path, phases: Phases) -> list[float]:
    import transformers
    from trl.trainer import grpo_trainer

    phases.wrap(transformers.GenerationMixin, "generate", "rollouts")
    phases.wrap(grpo_trainer.GRPOTrainer, "_calculate_rewards", "rewards")
    phases.wrap(grpo_trainer.GRPOTrainer, "_get_per_token_logps_and_entropies",
                lambda *args, **kwargs: "loss forward" if torch.is_grad_enabled() else "no-grad logps")
    original = phases.wrap(torch.Tensor, "backward", "backward")
    times = bench_grpo.trl_steps(folder, a, tmp)
    torch.Tensor.backward = original
    phases.table("TRL GRPOTrainer", times)


def rollout_cprofile(folder: Path, a, tmp: Path) -> None:
    """cProfile of lmkit's rollouts over the bench's steps: the functions with the most time of their own."""
    from lmkit.finetune import grpo

    profile = cProfile.Profile(time.process_time)
    original = grpo.GRPOJob.rollouts

    def profiled(self, *args):
        return profile.runcall(original, self, *args)

    grpo.GRPOJob.rollouts = profiled
    bench_grpo.lmkit_steps(folder, a, tmp)
    grpo.GRPOJob.rollouts = original
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    pstats.Stats(profile).sort_stats("cumulative").print_stats(30)


def rollout_ops(folder: Path, a, tmp: Path) -> None:
    """torch.profiler's operator table of the rollouts of the bench's last step, on each side."""
    import transformers
    from lmkit.finetune import grpo

    def profile_last(owner, name, label):
        original, calls = getattr(owner, name), []

        def profiled(*args, **kwargs):
            calls.append(1)
            if len(calls) < a.steps:
                return original(*args, **kwargs)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                out = original(*args, **kwargs)
            print(f"--- {label}: operators of one step's rollouts")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
            return out

        setattr(owner, name, profiled)
        return original

    if a.side in ("both", "lmkit"):
        original = profile_last(grpo.GRPOJob, "rollouts", "lmkit")
        bench_grpo.lmkit_steps(folder, a, tmp)
        grpo.GRPOJob.rollouts = original
    if a.side in ("both", "trl"):
        profile_last(transformers.GenerationMixin, "generate", "TRL (transformers generate)")
        bench_grpo.trl_steps(folder, a, tmp)


def main() -> None:
    p = bench_grpo.arguments(__doc__)
    p.add_argument("--side", choices=("both", "lmkit", "trl"), default="both")
    p.add_argument("--cprofile", action="store_true", help="also cProfile lmkit's rollouts")
    p.add_argument("--ops", action="store_true", help="also torch.profiler's operators of one step's rollouts")
    p.add_argument("--only-extra", action="store_true", help="skip the phase tables")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    phases = Phases()
    phases.optimizer_hooks()
    with tempfile.TemporaryDirectory() as tmp:
        folder = bench_grpo.make_folder(Path(tmp), a.width, a.layers, a.eos_logit)
        if a.side in ("both", "lmkit") and not a.only_extra:
            lmkit_side(folder, a, Path(tmp), phases)
        if a.side in ("both", "trl") and not a.only_extra:
            phases.seconds.clear()
            phases.rollouts = 0
            trl_side(folder, a, Path(tmp), phases)
        if a.cprofile:
            rollout_cprofile(folder, a, Path(tmp))
        if a.ops:
            rollout_ops(folder, a, Path(tmp))


if __name__ == "__main__":
    main()
