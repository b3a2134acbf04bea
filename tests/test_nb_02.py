import math

from conftest import notebook_claims


def test_batch_size_claims():
    c = notebook_claims("02")
    # throughput grows with the batch, and 4x more batch gains less at the large end than at the small end
    assert c["ch02/throughput_max_over_batch1"] > 2
    assert c["ch02/throughput_gain_largest_4x"] < c["ch02/throughput_gain_smallest_4x"]
    # the estimator's largest batch really fits, and one more sample does not
    assert c["ch02/max_batch_estimated"] >= 1
    assert c["ch02/max_batch_measured_fits"] is True
    assert c["ch02/max_batch_plus_one_exceeds"] is True
    # the loader was timed with and without workers (a timing: recorded, not asserted; on a busy machine
    # two workers can even be slower, which the notebook explains)
    assert c["ch02/loader_speedup_2_workers"] > 0 and c["ch02/loader_over_train_0_workers"] > 0
    # linear scaling rule on a CNN without normalisation: batch 16 at lr 0.01 against batch 128 at lr 0.08, with and
    # without warmup. At smoke (2,048 images, 6 epochs, one seed; chance is a test error of 0.9) the mechanism holds:
    # the small batch learns (measured 0.45). Each threshold below held for seeds 0, 1 and 2 at smoke, not only seed 0.
    assert c["ch02/small_batch_test_error"] < 0.6
    # without warmup the loss climbs above its first value, higher than with warmup, and the run ends clearly worse
    # (measured 7.2 > 6.4 and test error 0.90 against 0.64)
    assert c["ch02/no_warmup_max_loss"] > c["ch02/large_batch_first_loss"]
    assert c["ch02/no_warmup_max_loss"] > c["ch02/warmup_max_loss"]
    assert c["ch02/no_warmup_test_error"] > c["ch02/warmup_test_error"] + 0.05
    # with warmup the loss does not climb (by more than 20%) and the run learns, undoing part of the damage
    assert c["ch02/warmup_max_loss"] <= 1.2 * c["ch02/large_batch_first_loss"]
    assert c["ch02/warmup_test_error"] < 0.8
    assert c["ch02/warmup_gap_closed"] > 0.25
    # That warmup brings the large batch close to the small one (most of the gap closed, mean over three seeds) holds
    # at the cpu profile only (8,000 images): recorded there and quoted in the notebook, not asserted at smoke, where
    # the large batch's 96 steps are too few to catch up.
    # the gradient noise scale: positive in every repeat, with a finite spread
    assert c["ch02/noise_scale_all_positive"] is True
    assert c["ch02/noise_scale_mean"] > 0 and math.isfinite(c["ch02/noise_scale_std"])
