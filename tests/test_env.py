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


def test_gpu_profile_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("COURSE_PROFILE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert env.pick_profile() == "cpu"  # nothing asked: the CPU's profile
    with pytest.raises(ValueError, match=r"profile 'gpu' \(asked for\) needs a CUDA GPU.*Choose 'cpu'"):
        env.pick_profile("gpu")
    monkeypatch.setenv("COURSE_PROFILE", "gpu")
    with pytest.raises(ValueError, match=r"set by COURSE_PROFILE.*hours"):
        env.pick_profile()
    assert env.pick_profile("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert env.pick_profile() == "gpu"


def test_time_s_on_the_cpu():
    import time

    assert 0.05 <= env.time_s(lambda: time.sleep(0.05), "cpu") < 5


def test_progress_bars_follow_course_progress(monkeypatch):
    monkeypatch.setenv("COURSE_PROGRESS", "0")
    bar = env.progress(range(3), "steps")
    assert bar.disable and list(bar) == [0, 1, 2]
    monkeypatch.setenv("COURSE_PROGRESS", "1")
    assert env.show_progress() and not env.progress(range(3), "steps").disable
