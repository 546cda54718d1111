"""The orthonormal Walsh-Hadamard rotation over head_dim that the turbo codecs store in.

rotate(x) = H (signs * x) with H the normalised Sylvester-Hadamard matrix. The +-1 signs are
fixed: sign i is bit 0 of the i-th output of splitmix64 seeded with 0x5EED (plain integer
arithmetic, so every process, machine and kernel agrees). Head dims that are not a power of two
are split into power-of-two blocks, largest first (96 = 64 + 32, 80 = 64 + 16), each rotated on
its own: the whole map stays orthonormal, so q.k = rotate(q).rotate(k).
"""

from __future__ import annotations

import functools
import math

import torch

SIGN_SEED = 0x5EED
_MASK = (1 << 64) - 1


def _splitmix64(seed: int, n: int) -> list[int]:
    out, s = [], seed
    for _ in range(n):
        s = (s + 0x9E3779B97F4A7C15) & _MASK
        z = s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        out.append(z ^ (z >> 31))
    return out


def signs(head_dim: int) -> torch.Tensor:
    """float32 [head_dim] of +-1."""
    return torch.tensor([1.0 if v & 1 else -1.0 for v in _splitmix64(SIGN_SEED, head_dim)])


def power_of_two_blocks(head_dim: int) -> list[int]:
    """head_dim split into powers of two, largest first (each >= 1)."""
    return [1 << b for b in range(head_dim.bit_length() - 1, -1, -1) if head_dim >> b & 1]


def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@functools.lru_cache(maxsize=None)
def _matrix_cpu(head_dim: int) -> torch.Tensor:
    blocks = [_hadamard(b) for b in power_of_two_blocks(head_dim)]
    h = torch.block_diag(*blocks)
    return (h * signs(head_dim).double()[None, :]).float()  # R = H diag(signs)


@functools.lru_cache(maxsize=None)
def _matrix(head_dim: int, device: str) -> torch.Tensor:
    return _matrix_cpu(head_dim).to(device)


def rotation_matrix(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [head_dim, head_dim] orthonormal R with rotate(x) = R @ x."""
    return _matrix(head_dim, str(torch.device(device)))


def rotate(x: torch.Tensor) -> torch.Tensor:
    """float32 [..., D] -> R x over the last dim."""
    r = rotation_matrix(x.shape[-1], x.device)
    return x.float() @ r.T


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """Inverse of rotate: R^T y over the last dim."""
    r = rotation_matrix(y.shape[-1], y.device)
    return y.float() @ r
