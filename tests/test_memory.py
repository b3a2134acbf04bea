import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib import memory
from course_lib.models import MLP, ResNet, TinyTransformer, lm_loss


def _measure_acts(model, x, y, loss_fn):
    return memory.saved_activation_bytes(lambda: loss_fn(model(x), y), exclude=model.parameters())


def test_saved_activation_bytes_counts_a_shared_tensor_once():
    model = nn.Sequential(nn.Linear(100, 200), nn.ReLU(), nn.Linear(200, 10))
    x = torch.randn(8, 100)
    # Linear1 saves x (8x100); ReLU saves its output (8x200), which Linear2 saves too: stored once.
    assert memory.saved_activation_bytes(lambda: model(x), exclude=model.parameters()) == (800 + 1600) * 4


def test_saved_activation_bytes_counts_parameters_unless_excluded():
    model = nn.Linear(10, 10)
    x = torch.randn(4, 10, requires_grad=True)  # so the backward needs the weight, to form dL/dx
    with_params = memory.saved_activation_bytes(lambda: model(x))
    without = memory.saved_activation_bytes(lambda: model(x), exclude=model.parameters())
    assert with_params == without + 10 * 10 * 4


@pytest.mark.parametrize("name", ["mlp", "resnet", "resnet_gn", "transformer", "transformer_dropout"])
def test_estimator_within_five_percent_of_measurement(name):
    torch.manual_seed(0)
    img = (torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))
    tok = (torch.randint(0, 64, (4, 32)), torch.randint(0, 64, (4, 32)))
    model, (x, y), loss_fn = {
        "mlp": (MLP(), img, F.cross_entropy),
        "resnet": (ResNet(8), img, F.cross_entropy),
        "resnet_gn": (ResNet(8, norm_layer=lambda c: nn.GroupNorm(2, c)), img, F.cross_entropy),
        "transformer": (TinyTransformer(max_len=32), tok, lm_loss),
        "transformer_dropout": (TinyTransformer(max_len=32, dropout=0.1), tok, lm_loss),
    }[name]
    measured = _measure_acts(model, x, y, loss_fn)
    estimated = memory.estimate(model, tuple(x.shape))["activations"]
    assert abs(estimated - measured) / measured < 0.05


def test_estimate_parts_and_optimizer_state_match_torch():
    model = MLP(hidden=(32,))
    n = sum(p.numel() for p in model.parameters())
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    for name, opt in [("sgd", torch.optim.SGD(model.parameters(), lr=0.1)),
                      ("momentum", torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)),
                      ("adam", torch.optim.Adam(model.parameters()))]:
        measured = memory.measure(model, F.cross_entropy, x, y, opt)
        est = memory.estimate(model, (4, 3, 32, 32), optimizer=name)
        assert measured["params"] == est["params"] == 4 * n
        assert measured["grads"] == est["grads"] == 4 * n
        assert measured["optimizer"] == est["optimizer"]
    assert est["total"] == sum(est[k] for k in ("params", "grads", "optimizer", "activations"))


def test_estimate_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown optimizer"):
        memory.estimate(MLP(), (2, 3, 32, 32), optimizer="lion")
    with pytest.raises(ValueError, match="does not fit"):
        memory.estimate(ResNet(8), (2, 1, 32, 32))  # one channel, the model wants three
    with pytest.raises(ValueError, match="does not fit"):
        memory.estimate(MLP(), (2, 3, 16, 16))


def test_zero_memory_reproduces_the_paper():
    # Rajbhandari et al. 2020, Figure 1: 7.5B parameters, 64 devices, K = 12
    assert memory.zero_memory(1, 1, 0) == 16
    got = [memory.zero_memory(7.5e9, 64, s) / 1e9 for s in range(4)]
    assert got == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.06)
    with pytest.raises(ValueError):
        memory.zero_memory(1e9, 8, 4)


def test_largest_fitting_finds_the_boundary():
    calls = []

    def fits(n):
        calls.append(n)
        return n <= 37

    assert memory.largest_fitting(fits) == 37
    assert len(calls) <= 2 * 6 + 2
    assert memory.largest_fitting(lambda n: False) == 0
    assert memory.largest_fitting(lambda n: True, limit=100) == 100


def test_cpu_peak_sees_a_temporary():
    def work():
        big = torch.ones(1_000_000)  # 4 MB, freed at the end of the function
        return big.sum()

    peak = memory.cpu_peak_bytes(work)
    assert 4_000_000 <= peak < 8_000_000
