"""ppo_affine/testing/live_bytes.py: the bytes of tensor storage alive at once, what tests and bench/ compare the
memory plan with on the CPU."""
import torch

from ppo_affine.testing.live_bytes import LiveBytes


def test_new_tensors_count_and_freed_ones_stop_counting():
    live = LiveBytes()
    with live.mode:
        first = torch.ones(1000, 100)  # 400 000 bytes
        second = first * 2  # 400 000 more
        del first, second
        third = torch.zeros(50_000)  # 200 000, after both went
    assert live.peak == 800_000
    assert live.live == 200_000
    del third


def test_a_view_or_in_place_result_of_a_tensor_made_before_is_no_new_memory():
    weight = torch.ones(1000, 1000)  # 4 MB, made before: a model's weight
    live = LiveBytes()
    with live.mode:
        x = torch.ones(10, 1000)  # 40 000 bytes
        y = torch.nn.functional.linear(x, weight)  # multiplies by weight.t(), a view of the weight: 40 000 bytes out
        weight.mul_(1.0)  # in place: the weight's own storage
        z = weight[:5]  # a view
    # only x and y were allocated; counted, the weight's 4 MB would stay counted for good (weights are never freed)
    assert live.peak == 80_000, live.peak
    del y, z
