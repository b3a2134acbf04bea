import math

from conftest import notebook_claims


def test_batch_size_claims():
    c = notebook_claims("02")
    # throughput grows with the batch, and 4x more batch gains less at the large end than at the small end
    # (measured in interleaved rounds, fastest of each; on a CPU in one thread's CPU time, which other processes
    # do not inflate)
    assert c["ch02/throughput_clock"] in ("CPU time, 1 thread", "wall clock")
    assert c["ch02/throughput_max_over_batch1"] > 2
    assert c["ch02/throughput_gain_largest_4x"] < c["ch02/throughput_gain_smallest_4x"]
    # the estimator's largest batch really fits, and one more sample does not
    assert c["ch02/max_batch_estimated"] >= 1
    assert c["ch02/max_batch_measured_fits"] is True
    assert c["ch02/max_batch_plus_one_exceeds"] is True


def test_loader_claims():
    c = notebook_claims("02")
    # Two workers against the main process at one thread (as each worker runs) can at most double the rate: a
    # loose bound (timings), which a measurement that compares unlike things (the old 11x) breaks.
    assert 0 < c["ch02/loader_speedup_2_workers"] < min(2, c["ch02/cpu_count"]) + 1
    assert c["ch02/loader_over_train_0_workers"] > 0 and c["ch02/loader_threads_over_one_thread"] > 0


def test_warmup_claims(profile):
    c = notebook_claims("02")
    # linear scaling rule on a CNN without normalisation: batch 16 at lr 0.01 against batch 128 at lr 0.08, with and
    # without warmup. At smoke (2,048 images, 6 epochs, one seed; chance is a test error of 0.9) the mechanism holds:
    # the small batch learns (measured 0.42). Each threshold below held for seeds 0, 1 and 2 at smoke, not only seed 0.
    assert c["ch02/small_batch_test_error"] < 0.6
    # without warmup the loss climbs above its first value, higher than with warmup, and the run ends clearly worse
    # (measured 7.9 > 6.6 and test error 0.91 against 0.61)
    assert c["ch02/no_warmup_max_loss"] > c["ch02/large_batch_first_loss"]
    assert c["ch02/no_warmup_max_loss"] > c["ch02/warmup_max_loss"]
    assert c["ch02/no_warmup_test_error"] > c["ch02/warmup_test_error"] + 0.05
    # with warmup the loss does not climb (by more than 20%) and the run learns, undoing part of the damage
    assert c["ch02/warmup_max_loss"] <= 1.2 * c["ch02/large_batch_first_loss"]
    assert c["ch02/warmup_test_error"] < 0.8
    assert c["ch02/warmup_gap_closed"] > 0.25
    # the runs went through course_lib.parallel_runs: every one came back, each with its CPU time
    timing = c["ch02/lr_runs_seconds"]
    assert timing["runs"] == 3 * c["ch02/lr_seeds"] and timing["processes"] >= 1 and timing["cpu"] > 0
    if profile == "smoke":  # one seed and 96 large-batch steps: the rest needs the cpu profile
        return
    # at cpu, over nine seeds (4,000 images, 5 epochs): a run without warmup either stalls at chance or recovers to
    # about the warmed-up level (measured with AVX-512 / AVX2 kernels: 6 of 9 stalled; mean test error 0.36 / 0.36
    # small batch, 0.78 / 0.76 no warmup, 0.49 / 0.47 warmup), so the claims are on means: each seed-by-seed
    # difference is more than twice its standard error above zero (measured +0.29 +- 0.06 / +0.30 +- 0.06 against
    # warmup, +0.42 +- 0.06 / +0.40 +- 0.06 against the small batch, +1.0 +- 0.3 in the largest loss over the
    # first); no warmed-up run climbed by more than 20% (largest 1.12x), none stalled; and warmup removed most of
    # the gap (measured 68% / 74%)
    assert c["ch02/lr_seeds"] >= 5
    for key in ("ch02/no_warmup_minus_warmup_error", "ch02/no_warmup_minus_small_batch_error",
                "ch02/max_loss_ratio_no_warmup_minus_warmup"):
        mean, se = c[key]
        assert se > 0 and mean > 2 * se, key
    ratios = c["ch02/max_loss_over_first"]
    assert min(ratios["no_warmup"]) > 1 and max(ratios["warmup"]) <= 1.2
    assert c["ch02/stalled_runs"]["no_warmup"] >= 1 and c["ch02/stalled_runs"]["warmup"] == 0
    assert c["ch02/warmup_gap_closed"] > 0.5


def test_noise_scale_claims():
    c = notebook_claims("02")
    init, trained = c["ch02/noise_scale_init"], c["ch02/noise_scale_trained"]
    # by definition (per-sample gradients): small at initialisation, below the small batch of 16 (measured 3.8),
    # and it grows with training (measured 247 and 129 at cpu, AVX-512 and AVX2 kernels): the true gradient
    # shrinks, the per-sample noise does not
    assert 0 < init < 16 < trained
    # so the best rate grows far less than 8x from batch 16 to 128 at the start (measured 1.2), more after training
    assert c["ch02/best_lr_ratio_init"] < 2 < c["ch02/best_lr_ratio_trained"] < 8
    # the paper's two-batch estimator: positive in every repeat, and within twice its spread of the definition
    assert c["ch02/noise_scale_all_positive"] is True
    for direct, two in ((init, c["ch02/noise_scale_two_batch_init"]), (trained, c["ch02/noise_scale_two_batch_trained"])):
        mean = sum(two) / len(two)
        std = (sum((e - mean) ** 2 for e in two) / (len(two) - 1)) ** 0.5
        assert math.isfinite(std) and abs(mean - direct) < 2 * std + 0.1 * direct


def test_one_timing_lies():
    c = notebook_claims("02")
    assert c["ch02/first_call_over_fastest"] > 1.0  # the first call at a new shape pays for what later calls reuse
    assert c["ch02/repeat_spread"] >= 1.0
