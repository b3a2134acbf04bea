"""Chapter 01: the activation estimator against the saved-tensor measurement, on the course's models.

- ``estimator_error``: the worst relative error of ``estimator.estimate`` in fp32 over the MLP, the ResNet with
  BatchNorm, GroupNorm and MABN, and the tiny transformer with dropout, at chapter-01 sizes.
- ``estimator_error_bf16``: the same under bf16 autocast (``precision="bf16"``).
Measured on the GPU when there is one, else on the CPU, with the estimator told which: autocast's op lists
differ between the two, and so do its rules (tests/test_memory.py checks the CUDA rules with fake tensors).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib import estimator, memory, norms
from course_lib.models import MLP, ResNet, TinyTransformer, lm_loss


def _resnet(kind: str) -> torch.nn.Module:
    net = ResNet(16, norm_layer=lambda c: norms.make_norm(kind, c))
    return norms.centralize_convs(net) if kind == "mabn" else net


def run() -> dict[str, dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    img = (torch.randn(32, 3, 32, 32, device=device), torch.randint(0, 10, (32,), device=device))
    tok = (torch.randint(0, 64, (8, 128), device=device), torch.randint(0, 64, (8, 128), device=device))
    cases = [(MLP(), img, F.cross_entropy)] + [(_resnet(k), img, F.cross_entropy) for k in ("bn", "gn", "mabn")]
    cases.append((TinyTransformer(d_model=128, n_layers=4, max_len=128, dropout=0.1), tok, lm_loss))
    table = {}
    for precision in ("fp32", "bf16"):
        amp = memory.PRECISIONS[precision]
        worst = 0.0
        for model, (x, y), loss_fn in cases:
            model = model.to(device)
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                measured = memory.saved_activation_bytes(lambda: loss_fn(model(x), y), exclude=model.parameters())
            estimated = estimator.estimate(model, tuple(x.shape), precision=precision, device=device)["activations"]
            worst = max(worst, abs(estimated - measured) / measured)
        name = "estimator_error" if precision == "fp32" else "estimator_error_bf16"
        table[name] = {"value": worst, "goal": "<= 0.05"}
    return table
