"""Fixtures of the worker tests."""

import pytest
import torch
from test_runner import NUM_BLOCKS, PLANE_BYTES


@pytest.fixture
def planes():
    """Two KV planes (layers) of random bytes, as the copy engines see them."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (NUM_BLOCKS, PLANE_BYTES), dtype=torch.uint8, generator=gen)
            for _ in range(2)]
