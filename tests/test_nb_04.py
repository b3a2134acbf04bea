"""Chapter 04's claims, measured by the notebook (at the smoke profile in CI)."""

from conftest import notebook_claims


def test_batch_statistics_noise_falls_like_one_over_sqrt_batch():
    c = notebook_claims("04")
    assert -0.65 < c["ch04/mean_spread_slope"] < -0.35  # 1/sqrt(B) is a slope of -0.5 on log-log axes
    assert -0.65 < c["ch04/var_spread_slope"] < -0.3
    assert c["ch04/train_eval_gap_b2"] > 2.5 * c["ch04/train_eval_gap_b32"]  # sqrt(16) = 4 expected


def test_group_norm_by_hand_equals_torch_and_ignores_the_batch():
    c = notebook_claims("04")
    assert c["ch04/gn_output_max_abs_diff"] < 1e-10  # float64
    assert c["ch04/gn_grad_max_abs_diff"] < 1e-10
    assert c["ch04/ln_as_gn_max_abs_diff"] < 1e-5  # float32
    assert c["ch04/in_as_gn_max_abs_diff"] < 1e-5
    assert c["ch04/gn_batch_dependence"] < 1e-6
    assert c["ch04/bn_batch_dependence"] > 0.1


def test_mabn_backward_and_its_smaller_dependence_on_batch_mates():
    c = notebook_claims("04")
    assert c["ch04/mabn_gradcheck"] is True
    assert c["ch04/mabn_grad_vs_autograd_max_abs_diff"] < 1e-10
    assert c["ch04/mabn_sma_backward_rel_diff"] > 0.005  # with m > 1 it is deliberately not autograd's gradient
    assert c["ch04/mabn_over_bn_mates_output"] < 0.25  # the current batch is 1/16 of the statistic
    assert c["ch04/mabn_over_bn_mates_grad"] < 0.25
    assert c["ch04/mabn_renorm_mates_output_spread"] < 1e-4  # renormalised: x / sqrt(EMA), no batch-mate at all
    assert c["ch04/cenconv_mean_share"] < 0.75 * c["ch04/plain_conv_mean_share"]


def test_bn_and_mabn_fold_into_the_conv_and_gn_does_not():
    c = notebook_claims("04")
    assert c["ch04/fold_bn_max_abs_diff"] < 1e-4
    assert c["ch04/fold_mabn_max_abs_diff"] < 1e-4
    assert c["ch04/gn_fold_refused"] is True
    # timings are recorded, not asserted at smoke: a shared CI machine makes them noisy
    assert all(v > 0 for v in c["ch04/infer_ms"].values())


def test_experiment_ran_and_at_full_profiles_bn_degrades_with_the_group(profile):
    c = notebook_claims("04")
    errors = c["ch04/test_error"]
    assert set(errors) == {"bn", "gn", "mabn"}
    per_device, gn_compare = c["ch04/mabn_per_device_error"], c["ch04/gn_compare_error"]
    nf_runs = [e for each in c["ch04/nf_error"].values() for e in each]  # the NF-ResNet's runs (section 5)
    runs = [e for per in errors.values() for each in per.values() for e in each] + per_device + gn_compare + nf_runs
    assert all(0 <= e <= 1 for e in runs)
    assert len({tuple(each) for each in errors["gn"].values()}) == 1  # one GN run per seed serves every group size
    timing = c["ch04/experiment_seconds"]  # every run came back through course_lib.parallel_runs
    assert timing["runs"] == len(runs) - len(errors["gn"]["2"]) and timing["processes"] >= 1 and timing["cpu"] > 0
    # every difference carries its number of seeds; the per-device runs that ended at chance are named and left out
    for key in ("bn_rise", "gn_minus_bn_large", "gn_minus_bn_small", "mabn_minus_bn_large", "mabn_rise",
                "mabn_minus_bn_small") + (("gn_compare_minus_chosen",) if gn_compare else ()):
        mean, se, n = c[f"ch04/{key}"]
        assert -1 <= mean <= 1 and se >= 0 and n >= 1, key
    diverged = c["ch04/mabn_per_device_diverged"]
    assert len(diverged) <= len(per_device)
    assert sum(e >= 0.85 for e in per_device) == len(diverged)
    assert c["ch04/mabn_per_device_minus_sequential"][2] == len(per_device) - len(diverged)
    if profile == "smoke":  # a few steps of training: only the mechanism is asserted
        return
    # the batch (32), the optimizer and the steps are fixed; only the images per device that BN and MABN
    # normalise over change (32, 2). Every claim is on seed-by-seed differences, beyond twice their standard
    # error: [mean, standard error, seeds]. Measured figures below: an idle 2-core EPYC, one thread a run, with
    # AVX-512 kernels and then AVX2 ones, three seeds at cpu (24 runs of 450 steps).
    assert len(errors["bn"]["2"]) >= 3 and len(per_device) >= 3
    # groups of 4 channels are run at gpu (three seeds); at cpu they do not fit the budget on an AVX2-only CPU
    assert (len(gn_compare) >= 3) if profile == "gpu" else (gn_compare == [])

    def shown(key: str, seeds: int) -> float:
        mean, se, n = c[f"ch04/{key}"]
        assert n >= seeds and se > 0 and abs(mean) > 2 * se, (key, mean, se, n)
        return mean

    # BN gets worse with 2 images per device (measured +12.8 +- 0.7 points, 17.3 % -> 30.1 %; AVX2 +10.5 +- 1.2)
    assert shown("bn_rise", 3) > 0
    # GN, with groups of 2 channels, is ahead of BN at 2 images per device (measured -5.9 +- 2.0 points; AVX2
    # -3.9 +- 0.5) and behind it at 32 (+6.9 +- 1.8; AVX2 +6.6 +- 1.6): the lines cross, as in Wu & He's Figure 1
    assert shown("gn_minus_bn_small", 3) < 0
    assert shown("gn_minus_bn_large", 3) > 0
    if profile == "gpu":  # groups of 4 channels against 2, seed by seed on three seeds (not yet run on a GPU)
        assert shown("gn_compare_minus_chosen", 3) != 0
    else:
        assert "ch04/gn_compare_minus_chosen" not in c  # not run at cpu: nothing recorded, nothing claimed
    # MABN with per-device buffers (16 steps old) is worse than with its groups run in sequence (one step old), over
    # the seeds that did not diverge, which must be most of them (measured: none diverged, +37.0 +- 14.0 points;
    # AVX2 +20.5 +- 2.1), in training loss too (measured +1.1 +- 0.3 nats; AVX2 +0.5 +- 0.04)
    assert len(c["ch04/mabn_per_device_diverged"]) <= len(per_device) - 2
    assert shown("mabn_per_device_minus_sequential", 2) > 0
    assert shown("mabn_per_device_minus_sequential_loss", 2) > 0
    assert c["ch04/mabn_sequential_diverged"] == []
    # MABN at 32 images (one group, a buffer of one batch) is behind BN in this short training (measured +10.4 +- 2.2
    # points; AVX2 +9.5 +- 3.3), and at 2 images it is not better than BN (measured +2.7 +- 3.2; AVX2 +1.1 +- 2.9:
    # not below BN by twice its error); its own rise to 2 images (+5.1 +- 2.0; AVX2 +2.1 +- 1.0) is printed and
    # called small beside BN's, not asserted
    assert shown("mabn_minus_bn_large", 3) > 0
    mean, se, n = c["ch04/mabn_minus_bn_small"]
    assert n >= 3 and mean > -2 * se


def test_nf_resnet_keeps_its_variance_and_agc_clips_unit_by_unit():
    c = notebook_claims("04")
    # the expected variances (fixed numbers) hold on the inputs the derivation assumes (measured: within 9.3 %)
    assert c["ch04/nf_var_rel_gap_noise"] < 0.2
    # on images the stem's output has less variance (measured 0.62 of 1), the same share at every block after it
    assert c["ch04/nf_var_ratio_spread_images"] < 1.3 and max(c["ch04/nf_var_ratio_images"]) < 1
    assert c["ch04/nf_batch_dependence"] < 1e-5  # no batch statistics
    assert c["ch04/agc_by_hand_max_abs_diff"] < 1e-6  # adaptive_clip_ is the formula, unit by unit
    assert abs(c["ch04/agc_share_by_hand_minus_library"]) < 1e-6  # the same units counted (float32 share)
    assert c["ch04/agc_fc_unchanged"] is True  # the classifier is not clipped, as in the paper


def test_agc_lets_the_nf_resnet_train_at_the_chapters_learning_rate_but_not_catch_up(profile):
    c = notebook_claims("04")
    nf = c["ch04/nf_error"]
    assert len(nf["nf_no_agc"]) == len(nf["nf_agc"]) >= 2
    assert all(0 <= e <= 1 for each in nf.values() for e in each)
    chance = c["ch04/nf_at_chance"]  # named, and left out of the differences
    for arm in ("nf_no_agc", "nf_agc"):
        assert len(chance[arm]) == sum(e >= 0.85 for e in nf[arm]), arm
    assert c["ch04/nf_no_agc_minus_agc"][2] == len(nf["nf_agc"]) - len(set(chance["nf_no_agc"]) | set(chance["nf_agc"]))
    for key in ("nf_agc_minus_gn", "nf_agc_minus_bn_large", "nf_agc_minus_bn_small"):
        mean, se, n = c[f"ch04/{key}"]
        assert n == len(nf["nf_agc"]) - len(chance["nf_agc"]) and se >= 0, key
        assert -1 <= mean <= 1 if n else mean == "nan", key  # at smoke every run may end at chance: nothing to pair
    assert ("ch04/nf_low_lr_minus_agc" in c) == bool(nf["nf_low_lr"])
    assert all(0 <= v <= 1 for v in c["ch04/nf_agc_clipped_share"])
    if profile == "smoke":  # a few steps: the mechanism only
        return
    assert len(nf["nf_agc"]) >= 3
    assert (len(nf["nf_low_lr"]) >= 3) if profile == "gpu" else (nf["nf_low_lr"] == [])

    def shown(key: str, seeds: int) -> float:
        mean, se, n = c[f"ch04/{key}"]
        assert n >= seeds and se > 0 and abs(mean) > 2 * se, (key, mean, se, n)
        return mean

    # at lr 0.3 without clipping the NF-ResNet does not train (measured on seeds 0-2: 79.4, 82.0, 65.6 % with
    # AVX-512 kernels, 86.8, 58.6, 86.1 % with AVX2); with AGC at 0.08 every seed trains (36.8, 33.9, 32.3 %;
    # AVX2 36.1, 33.1, 34.2 %): worse without on every seed, by 33 points or more (AVX2: 25)
    assert c["ch04/nf_at_chance"]["nf_agc"] == []
    assert c["ch04/nf_agc_gain_min"] > 0.2
    assert max(nf["nf_agc"]) < 0.6
    # AGC bounds some steps, it does not rescale every gradient (measured: 17-20 % of the units a step)
    assert 0 < max(c["ch04/nf_agc_clipped_share"]) < 0.5
    # with AGC it is still behind GN and BN at 32 and 2 images (measured +10.1 +- 1.9, +17.0 +- 0.7 and +4.2 +- 1.4
    # points over 3 seeds; AVX2 +9.2 +- 0.8, +15.8 +- 1.0, +5.3 +- 0.4)
    assert shown("nf_agc_minus_gn", 3) > 0
    assert shown("nf_agc_minus_bn_large", 3) > 0
    assert shown("nf_agc_minus_bn_small", 3) > 0
