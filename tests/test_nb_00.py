import torch
from conftest import notebook_claims


def test_start_here_claims():
    c = notebook_claims("00")
    assert c["ch00/image_shape"] == [3, 32, 32]
    assert c["ch00/num_classes"] == 10
    assert c["ch00/same_seed_same_data"] is True
    assert c["ch00/other_seed_differs"] is True
    assert c["ch00/min_class_share"] > 0.07  # ten balanced classes: 0.1 each, give or take sampling noise
    assert c["ch00/train_images_per_s"] > 0
    assert c["ch00/cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert c["ch00/cpu_bf16_over_fp32"] > 0
    from course_lib import kernels
    assert set(c["ch00/kernels"]) == set(kernels.KERNELS)  # every probed kernel, with its verdict
    for v in c["ch00/kernels"].values():
        assert v["verdict"] in kernels.VERDICTS and (v["error"] is not None) == (v["verdict"] == "broken" and not v["forced"])
