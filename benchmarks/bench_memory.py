"""Chapter 01: the activation estimator against the saved-tensor measurement, on the course's three models."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib import memory
from course_lib.models import MLP, ResNet, TinyTransformer, lm_loss


def run() -> dict[str, dict]:
    torch.manual_seed(0)
    img = (torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,)))
    tok = (torch.randint(0, 64, (8, 128)), torch.randint(0, 64, (8, 128)))
    cases = [(MLP(), img, F.cross_entropy), (ResNet(16), img, F.cross_entropy),
             (TinyTransformer(d_model=128, n_layers=4, max_len=128, dropout=0.1), tok, lm_loss)]
    worst = 0.0
    for model, (x, y), loss_fn in cases:
        measured = memory.saved_activation_bytes(lambda: loss_fn(model(x), y), exclude=model.parameters())
        estimated = memory.estimate(model, tuple(x.shape))["activations"]
        worst = max(worst, abs(estimated - measured) / measured)
    return {"estimator_error": {"value": worst, "goal": "<= 0.05"}}
