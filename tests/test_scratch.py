"""The fused step's named buffers: numpy and tensor views of one name share its memory at every shape."""

import numpy as np
import torch

from s4r.kernels.scratch import Scratch, thread_scratch


def test_numpy_and_tensor_views_of_a_name_share_memory():
    scratch = Scratch()
    arr = scratch.np("buf", (3, 4))
    tensor, same = scratch.view("buf", (3, 4), torch.float32)
    arr[...] = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert torch.equal(tensor, torch.arange(12, dtype=torch.float32).view(3, 4))
    assert np.shares_memory(arr, same)
    assert scratch.np("buf", (2, 6)).ravel().tolist() == list(range(12))  # another shape, same words
    assert scratch.np("buf", (3, 4)) is arr  # a shape asked before costs a lookup


def test_a_larger_shape_or_another_dtype_regrows_the_buffer():
    scratch = Scratch()
    small = scratch.np("buf", (4,))
    large = scratch.np("buf", (1000,))
    assert large.shape == (1000,) and not np.shares_memory(small, large)
    tensor = scratch.get("buf", (10,))
    assert np.shares_memory(tensor.numpy(), large)
    words = scratch.np("buf", (8,), torch.bfloat16)  # bf16 as its bits
    assert words.dtype == np.uint16 and scratch.get("buf", (8,), torch.bfloat16).dtype == torch.bfloat16
    assert np.shares_memory(words, scratch.view("buf", (8,), torch.bfloat16)[1])


def test_views_made_under_inference_mode_take_writes_outside_it():
    scratch = Scratch()
    with torch.inference_mode():
        tensor = scratch.get("out", (2, 2))
    torch.matmul(torch.eye(2), torch.ones(2, 2), out=tensor)  # torch refuses this for an inference tensor
    assert scratch.np("out", (2, 2)).sum() == 4


def test_each_thread_position_has_its_own_scratch():
    assert thread_scratch(0) is thread_scratch(0)
    assert thread_scratch(1) is not thread_scratch(0)
