"""Chapter 11: what the memory techniques cost in time, as ratios of step times measured in one run.

- ``fused_attention_time_ratio``: a training step of the tiny transformer with
  ``F.scaled_dot_product_attention`` over the op-by-op attention, at a sequence
  length where the ``T x T`` matrices dominate. The fused kernel reads and writes
  far fewer bytes: it should be no slower.
- ``chunked_loss_time_ratio``: the loss over a 32k vocabulary in 4 chunks
  (``chunked_cross_entropy``) over the plain loss. A third more FLOPs, but the
  softmax passes are bound by memory bandwidth and run twice, and every chunk
  reads and writes the whole weight gradient: at most 2x (measured 1.7x on a
  busy 2-core CPU; 16 chunks there cost 4x).
- ``offload_time_ratio``: a step with every block's saves offloaded by
  ``OffloadToHost`` over a plain one. On a GPU the copies cross PCIe (pinned
  memory); on a CPU they are memory copies into NumPy arrays, so there it is a
  plain figure without a goal.
Each time is the fastest of a few runs taken in turns (``timing.fastest_times``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib import chunked_loss, offload
from course_lib.timing import fastest_times
from course_lib.models import TinyTransformer, lm_loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run() -> dict[str, dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    B, T = (8, 2048) if device.type == "cuda" else (2, 1024)
    idx = torch.randint(0, 64, (B, T), device=device)
    models = {}
    for fused in (False, True):
        torch.manual_seed(0)
        models[fused] = TinyTransformer(vocab=64, d_model=128, n_heads=4, n_layers=4, max_len=T, fused=fused).to(device)

    def step(model):
        def run_step():
            lm_loss(model(idx), idx).backward()
            _sync(device)
        return run_step

    hooks = offload.OffloadToHost(keep=models[False].parameters(), pin_memory=device.type == "cuda")
    torch.manual_seed(0)
    offloaded = TinyTransformer(vocab=64, d_model=128, n_heads=4, n_layers=4, max_len=T).to(device)
    offloaded.blocks = offload.offload_blocks(offloaded.blocks, hooks)
    times = fastest_times({"naive": step(models[False]), "fused": step(models[True]), "offload": step(offloaded)},
                          repeats=3)

    N, V, d = (8192, 32768, 512) if device.type == "cuda" else (1024, 32768, 64)
    h = torch.randn(N, d, device=device, requires_grad=True)
    w = (0.02 * torch.randn(V, d, device=device)).requires_grad_()
    y = torch.randint(0, V, (N,), device=device)

    def loss_step(fn):
        def run_step():
            fn().backward()
            _sync(device)
        return run_step

    loss_times = fastest_times({"plain": loss_step(lambda: F.cross_entropy(h @ w.t(), y)),
                                "chunked": loss_step(lambda: chunked_loss.chunked_cross_entropy(h, w, None, y, 4))},
                               repeats=3)
    return {
        "fused_attention_time_ratio": {"value": times["fused"] / times["naive"], "goal": "<= 1.0"},
        "chunked_loss_time_ratio": {"value": loss_times["chunked"] / loss_times["plain"], "goal": "<= 2.0"},
        "offload_time_ratio": {"value": times["offload"] / times["naive"],
                               "goal": "<= 2.0" if device.type == "cuda" else None},
    }
