from conftest import notebook_claims


def test_memory_anatomy_claims(profile):
    c = notebook_claims("01")
    assert c["ch01/grad_over_param_bytes"] == 1.0
    assert c["ch01/momentum_state_over_param_bytes"] == 1.0
    assert 2.0 < c["ch01/adam_state_over_param_bytes"] < 2.01  # two moments plus a scalar step per tensor
    assert c["ch01/hand_count_matches"] is True
    assert c["ch01/estimator_max_rel_error"] < 0.05
    assert c["ch01/experiment_max_rel_error"] < 0.05
    # "many times its weights" for the ResNet, "at most about the size of its weights" for the MLP
    assert c["ch01/resnet_activations_over_params"] > 10
    assert c["ch01/mlp_activations_over_params"] < 1.5
    # a float mask on the CPU, a 1-byte one on CUDA (the gpu profile runs on CUDA)
    assert c["ch01/dropout_mask_bytes_per_element"] == (1 if profile == "gpu" else 4)
    assert c["ch01/activation_per_sample_spread"] < 0.01  # "a fraction of a percent": linear in the batch
    assert c["ch01/mixed_adam_bytes_per_param"] == 16
    assert abs(c["ch01/model_states_7p5b_gb"] - 120) < 0.5


def test_freezing_and_lora_claims(profile):
    c = notebook_claims("01")
    # section 6: every count is its formula (the states to the byte, the activations to the estimator's few bytes)
    assert c["ch01/ft_exact_states"] is True
    assert c["ch01/ft_formula_max_rel_error"] < 1e-3
    assert c["ch01/frozen_prefix_saves_nothing"] is True
    assert c["ch01/first_trainable_saves_prefix_output"] is True
    assert c["ch01/lora_saves_more_per_block"] is True  # "LoRA saves more than full training, in every block"
    assert c["ch01/lora_acts_over_full"] > 1
    assert c["ch01/frozen_acts_over_full"] < 0.5          # "less than half the activations"
    assert c["ch01/lora_state_over_full"] < 0.5 < c["ch01/frozen_state_over_full"] < 1  # "most" vs "a small share"
    assert c["ch01/gpt3_lora_frozen_gb"] == 350
    # section 7: the run (at smoke only the mechanism: a few steps mean nothing)
    assert set(c["ch01/ft_accuracy"]) == {"full", "frozen prefix", "LoRA"}
    if profile != "smoke":
        assert c["ch01/ft_seeds_kept"] >= 3
        assert c["ch01/ft_min_accuracy"] > 2 * 0.2           # every run far above chance (20 %)
        frozen, lora_diff = c["ch01/ft_diff_vs_full"]["frozen prefix"], c["ch01/ft_diff_vs_full"]["LoRA"]
        assert abs(frozen[0]) < 0.02                         # "within about a point of full fine-tuning on average"
        assert lora_diff[0] < 0                              # "behind full fine-tuning on average"
