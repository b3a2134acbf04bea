import pytest
import torch

from course_lib import env


def test_pick_profile_from_argument_env_and_hardware(monkeypatch):
    monkeypatch.delenv("COURSE_PROFILE", raising=False)
    assert env.pick_profile() == ("gpu" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("COURSE_PROFILE", "smoke")
    assert env.pick_profile() == "smoke"
    assert env.pick_profile("cpu") == "cpu"  # an explicit choice wins over the variable


def test_unknown_profile_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="unknown profile 'laptop'.*smoke, cpu, gpu"):
        env.pick_profile("laptop")
    monkeypatch.setenv("COURSE_PROFILE", "huge")
    with pytest.raises(ValueError, match="COURSE_PROFILE"):
        env.pick_profile()


def test_sizes_lookup():
    table = {"smoke": 1, "cpu": 2, "gpu": 3}
    assert env.sizes("cpu", table) == 2
    with pytest.raises(KeyError, match="no entry for profile 'gpu'"):
        env.sizes("gpu", {"smoke": 1, "cpu": 2})


def test_seed_everything_reproduces():
    env.seed_everything(3)
    a = torch.randn(5)
    env.seed_everything(3)
    assert torch.equal(a, torch.randn(5))
    env.seed_everything(4)
    assert not torch.equal(a, torch.randn(5))


def test_small_profiles_stay_on_cpu():
    assert env.pick_device("smoke").type == "cpu"
    assert env.pick_device("cpu").type == "cpu"
