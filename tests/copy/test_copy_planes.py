"""planes_from_kv_tensor / describe_planes on the KV layouts of vLLM's attention backends,
built on CPU with distinct sizes so the block dim is unambiguous."""

from __future__ import annotations

import pytest
import torch

from kv_offload.copy.planes import describe_planes, planes_from_kv_tensor

NB, BS, HEADS, HD = 7, 16, 3, 8  # num_blocks differs from every other dim


def rand(shape, dtype=torch.bfloat16):
    return torch.randn(shape).to(dtype)


def block_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_cpu_backend_layout_is_one_plane():
    t = rand((NB, HEADS, BS, 2 * HD))  # [num_blocks, kv_heads, block_size, 2*head_size]
    (plane,) = planes_from_kv_tensor(t, NB)
    assert plane.dtype == torch.uint8 and plane.shape == (NB, HEADS * BS * 2 * HD * 2)
    for b in range(NB):
        assert plane[b].numpy().tobytes() == block_bytes(t[b])


def test_planes_are_views_writes_reach_the_kv_tensor():
    t = rand((NB, HEADS, BS, 2 * HD))
    (plane,) = planes_from_kv_tensor(t, NB)
    plane[3].zero_()
    assert torch.count_nonzero(t[3]) == 0
    assert torch.count_nonzero(t[2]) > 0


def test_flash_attention_layout_gives_k_and_v_planes():
    t = rand((2, NB, BS, HEADS, HD))
    k, v = planes_from_kv_tensor(t, NB)
    assert k.shape == v.shape == (NB, BS * HEADS * HD * 2)
    for b in range(NB):
        assert k[b].numpy().tobytes() == block_bytes(t[0, b])
        assert v[b].numpy().tobytes() == block_bytes(t[1, b])


def test_flash_attention_hnd_stride_order_is_accepted():
    """A logical (2, nb, bs, heads, hd) view over a physically head-major cache: the block's
    bytes are still one contiguous range, just in another order."""
    physical = rand((2, NB, HEADS, BS, HD))
    t = physical.permute(0, 1, 3, 2, 4)
    k, v = planes_from_kv_tensor(t, NB)
    for b in range(NB):
        assert k[b].numpy().tobytes() == block_bytes(physical[0, b])
        assert v[b].numpy().tobytes() == block_bytes(physical[1, b])


def test_flashinfer_layout_is_one_plane():
    t = rand((NB, 2, BS, HEADS, HD))
    (plane,) = planes_from_kv_tensor(t, NB)
    assert plane.shape == (NB, 2 * BS * HEADS * HD * 2)
    assert plane[5].numpy().tobytes() == block_bytes(t[5])


def test_mla_layout_is_one_plane():
    t = rand((NB, BS, 576))
    (plane,) = planes_from_kv_tensor(t, NB)
    assert plane.shape == (NB, BS * 576 * 2)


def test_fp8_and_storage_offset():
    big = torch.randint(0, 255, (NB + 1, BS, 32), dtype=torch.uint8).view(torch.float8_e4m3fn)
    t = big[1:]  # a view that starts one block into its storage
    (plane,) = planes_from_kv_tensor(t, NB)
    assert plane[0].numpy().tobytes() == block_bytes(big[1].view(torch.uint8))


def test_kernel_blocks_are_grouped_into_manager_blocks():
    t = rand((NB * 2, HEADS, BS, HD))  # two kernel blocks per manager block
    (plane,) = planes_from_kv_tensor(t, NB)
    assert plane.shape == (NB, 2 * HEADS * BS * HD * 2)
    assert plane[1].numpy().tobytes() == block_bytes(t[2:4])


def test_no_block_dim_is_a_clear_error():
    with pytest.raises(ValueError, match="block dim"):
        planes_from_kv_tensor(rand((5, BS, HD)), NB)


def test_non_contiguous_block_bytes_are_rejected():
    t = rand((NB, HEADS, BS, 4 * HD))[..., : 2 * HD]  # every row has a gap
    with pytest.raises(ValueError, match="contiguous"):
        planes_from_kv_tensor(t, NB)


def test_expanded_tensor_is_rejected():
    t = rand((NB, 1, HD)).expand(NB, BS, HD)
    with pytest.raises(ValueError):
        planes_from_kv_tensor(t, NB)


def test_ambiguous_block_dim_needs_block_dim():
    t = rand((2, HEADS, HEADS, BS, HD))  # num_blocks == HEADS: dims 1 and 2 both fit
    with pytest.raises(ValueError, match="block_dim"):
        planes_from_kv_tensor(t, HEADS)
    k, v = planes_from_kv_tensor(t, HEADS, block_dim=1)
    assert v[2].numpy().tobytes() == block_bytes(t[1, 2])


@pytest.mark.parametrize("bad", [0, -3])
def test_bad_num_blocks(bad):
    with pytest.raises(ValueError):
        planes_from_kv_tensor(rand((NB, BS)), bad)


def test_describe_planes_geometry():
    t = torch.zeros((NB, 2, 64), dtype=torch.uint8)
    geometry = describe_planes([t[:, 0], t[:, 1], torch.zeros((NB, 32), dtype=torch.uint8)])
    assert geometry.num_blocks == NB
    assert geometry.plane_bytes == (64, 64, 32)
    assert geometry.row_strides == (128, 128, 32)


@pytest.mark.parametrize("planes", [
    [],
    [torch.zeros((NB, 8), dtype=torch.float16)],
    [torch.zeros((NB, 8, 2), dtype=torch.uint8)],
    [torch.zeros((NB, 8), dtype=torch.uint8), torch.zeros((NB + 1, 8), dtype=torch.uint8)],
    [torch.zeros((8, NB), dtype=torch.uint8).t()],  # rows not contiguous
    [torch.zeros((NB, 8), dtype=torch.uint8, device="meta"),
     torch.zeros((NB, 8), dtype=torch.uint8)],
])
def test_describe_planes_rejects(planes):
    with pytest.raises(ValueError):
        describe_planes(planes)
