"""ops.hugepages.advise: huge-page advice for large CPU tensors changes no byte, and declines what
it cannot cover (tensors under 2 MiB of aligned interior, non-contiguous views)."""

from __future__ import annotations

import torch

from pagedkv.ops import hugepages


def test_advise_keeps_the_bytes():
    t = torch.randint(0, 256, (6 << 20,), dtype=torch.uint8)
    before = t.clone()
    got = hugepages.advise(t)
    assert isinstance(got, bool)
    assert torch.equal(t, before)
    t[123] ^= 1  # still an ordinary writable tensor
    assert int(t[123]) == int(before[123]) ^ 1


def test_advise_declines_small_and_strided():
    assert hugepages.advise(torch.zeros(1 << 20, dtype=torch.uint8)) is False  # < 2 MiB: no aligned huge page
    big = torch.zeros(4096, 4096, dtype=torch.float32)
    assert hugepages.advise(big[:, ::2]) is False
