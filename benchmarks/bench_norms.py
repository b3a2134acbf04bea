"""Chapter 04: what MABN costs in training, and what folding saves at inference.

- ``mabn_over_bn_step``: one SGD training step of the chapter's ResNet (width 16, batch 32) with MABN and
  weight-centralised convolutions, over the same step with ``nn.BatchNorm2d``. Goal: at most 1.5x, the
  price of computing MABN's statistics in Python ops rather than one fused kernel.
- ``ghost_bn_g2_over_bn_step``: the same step with BN statistics over 16 groups of 2 images
  (``GhostBatchNorm2d``, the experiment's smallest group) over plain BN. Goal: at most 1.3x: every
  group size costs about the same, which is what lets the experiment run them all at one batch.
- ``*_infer``: one inference forward pass (batch 64) of GroupNorm, unfolded BN and folded MABN, over
  folded BN (the fastest: convolutions and ReLUs only).

Runs on the GPU when there is one, else on the CPU. Each figure is the fastest of several runs taken in
turns (``timing.fastest_times``), so a busy moment on a shared machine hits every model alike; on a
CPU the clock is the CPU time of one thread, which other processes do not inflate.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from course_lib import norms
from course_lib.timing import fastest_times
from course_lib.models import ResNet

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _fastest(fns: dict[str, Callable[[], object]], repeats: int = 15) -> dict[str, float]:
    def timed(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            fn()
            _sync()
        return run

    if DEVICE.type == "cpu":  # one core's CPU time: neither other processes nor spinning threads inflate it
        return fastest_times({name: timed(fn) for name, fn in fns.items()}, repeats=repeats,
                             clock=time.process_time, threads=1)
    return fastest_times({name: timed(fn) for name, fn in fns.items()}, repeats=repeats)


def _resnet(kind: str, **options: object) -> nn.Module:
    net = ResNet(16, norm_layer=lambda c: norms.make_norm(kind, c, **options))
    return (norms.centralize_convs(net) if kind == "mabn" else net).to(DEVICE)


def _train_step(net: nn.Module, batch: int) -> Callable[[], object]:
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, 32, 32, device=DEVICE)
    y = torch.randint(0, 10, (batch,), device=DEVICE)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        opt.step()

    return step


def _randomised_eval(net: nn.Module) -> nn.Module:
    with torch.no_grad():  # non-trivial running statistics, as after training
        for m in net.modules():
            if isinstance(m, (nn.BatchNorm2d, norms.MABN2d)):
                m.running_var.uniform_(0.5, 2)
    return net.eval()


def run() -> dict[str, dict]:
    torch.manual_seed(0)
    train = _fastest({"bn": _train_step(_resnet("bn"), 32), "mabn": _train_step(_resnet("mabn"), 32),
                             "ghost_bn": _train_step(_resnet("bn", group_size=2), 32)})
    x = torch.randn(64, 3, 32, 32, device=DEVICE)
    models = {
        "bn": _randomised_eval(_resnet("bn")),
        "folded_bn": norms.fold_model(_randomised_eval(_resnet("bn"))),
        "folded_mabn": norms.fold_model(_randomised_eval(_resnet("mabn"))),
        "gn": _resnet("gn").eval(),
    }

    def infer(model: nn.Module) -> Callable[[], object]:
        def forward() -> None:
            with torch.inference_mode():
                model(x)
        return forward

    infer_t = _fastest({k: infer(m) for k, m in models.items()})
    base = infer_t["folded_bn"]
    return {
        "mabn_over_bn_step": {"value": train["mabn"] / train["bn"], "goal": "<= 1.5"},
        "ghost_bn_g2_over_bn_step": {"value": train["ghost_bn"] / train["bn"], "goal": "<= 1.3"},
        "gn_over_folded_bn_infer": {"value": infer_t["gn"] / base, "goal": None},
        "bn_over_folded_bn_infer": {"value": infer_t["bn"] / base, "goal": None},
        "folded_mabn_over_folded_bn_infer": {"value": infer_t["folded_mabn"] / base, "goal": None},
    }


if __name__ == "__main__":
    for name, entry in run().items():
        print(f"{name:>34}: {entry['value']:.3f}  (goal {entry['goal'] or '-'})")
