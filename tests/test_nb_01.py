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
