"""Triton store: encode new K/V rows and scatter them into their slots, one kernel for every codec.

One program encodes BLOCK_T tokens of one kv head: load (optionally subtract the centre: k_centre or v_centre), rotate
with the WHT as a matmul by the rotation matrix (rotated codecs), find the group scales, encode
each element, pack the codes 8 at a time into `BITS` bytes (the little-endian bit stream of
docs/internals.md) and write codes and scales at `slot`. The encode rules are the reference
encoder's (`pagedkv.codecs.reference`), written with integer rounding helpers so the bytes match:

- bf16: round to nearest even; fp8: E4M3 of x / tensor_scale; turbo8: bf16 scale amax/448, E4M3
  of x / scale; q8_0 / q4_0: llama.cpp rules with fp16 scales;
- nvfp4, turbo2/3/4/5 (groups of 16, 32 or 64): the same E4M3 scale search (10 candidates around
  amax / max|level|, least squared error of the group, first on ties) and nearest level (ties go
  down: the count of midpoints below the value, up to 31 of them for turbo5's 32 levels).

The WHT runs in the kernel for head_dim <= 128 (a [D, D] fp32 operand: 64 KiB of shared memory
at 128) as a 3xTF32 tensor-core matmul (fp32-accurate; exact fp32 FMAs of that tile spill
registers); larger head dims are rotated by one torch matmul just before the kernel.

Known deviation (documented, tested by tolerance on GPUs): for rotated codecs the WHT sums in a
different order (and on a GPU with 3xTF32 products) than the reference's matmul, so an element
within ~1e-7 of a decision boundary can take the neighbouring code or a group a neighbouring
scale. Under the interpreter the bytes matched the reference for every codec in the tests.
Elsewhere the bytes are identical (floating-point contraction is disabled in the launch,
divisions are IEEE).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...codecs import wht
from .. import transform
from ..batch import PagedLayer
from .common import bf16_bits, bf16_round, e4m3_bits, e4m3_value, fp16_bits, round_half_even
from .spec import ENC_BF16, ENC_E4M3, ENC_INT, ENC_TABLE, SCALE_TENSOR, codec_spec, codec_tables

_ENC_BF16 = tl.constexpr(ENC_BF16)
_ENC_E4M3 = tl.constexpr(ENC_E4M3)
_ENC_TABLE = tl.constexpr(ENC_TABLE)
_ENC_INT = tl.constexpr(ENC_INT)
_SCALE_TENSOR = tl.constexpr(SCALE_TENSOR)


@triton.jit
def _store_kernel(x_ptr, slot_ptr, pool_ptr, centre_ptr, rot_ptr, levels_ptr, mids_ptr, order_ptr,
                  tscale_ptr, T, num_slots, stride_t, stride_h,
                  H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                  BITS: tl.constexpr, GROUP: tl.constexpr, SCALE_KIND: tl.constexpr,
                  ROW_DATA: tl.constexpr, ROW_SCALE: tl.constexpr, DATA_END: tl.constexpr,
                  BLOCK_BYTES: tl.constexpr, ENCODE: tl.constexpr, ROTATED: tl.constexpr,
                  HAS_CENTRE: tl.constexpr, N_MIDS: tl.constexpr, MAX_LEVEL: tl.constexpr,
                  SEARCH_LO: tl.constexpr, SEARCH_N: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                  w_ptr=None, cos_ptr=None, sin_ptr=None, kf_ptr=None, eps=0.0,
                  NORM: tl.constexpr = False, ROPE: tl.constexpr = False, RD: tl.constexpr = 2):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    slot = tl.load(slot_ptr + rows, mask=rows < T, other=-1)
    keep = (slot >= 0) & (slot < num_slots)  # a slot past the pool writes nothing (checks=False on CUDA)
    mask = keep[:, None] & d_ok[None, :]
    x_row = x_ptr + rows[:, None].to(tl.int64) * stride_t + h * stride_h
    if NORM or ROPE:  # fused K path: per-head RMSNorm then RoPE, fp32, written out as stored
        row_ok = (rows < T)[:, None] & d_ok[None, :]
        x = tl.load(x_row + offs_d[None, :], mask=row_ok, other=0.0).to(tl.float32)
        if NORM:
            inv = 1.0 / tl.math.sqrt_rn(tl.sum(x * x, axis=1) / D + eps)
            x = x * inv[:, None] * tl.load(w_ptr + offs_d, mask=d_ok, other=0.0)[None, :]
        if ROPE:  # neox half split within the first RD elements: d pairs with d +- RD/2
            HALF: tl.constexpr = RD // 2
            lo_half = offs_d < HALF
            in_rot = offs_d < RD
            partner = tl.where(lo_half, offs_d + HALF, offs_d - HALF)
            xp = tl.load(x_row + partner[None, :], mask=row_ok & in_rot[None, :], other=0.0).to(tl.float32)
            if NORM:
                xp = xp * inv[:, None] * tl.load(w_ptr + partner, mask=in_rot, other=0.0)[None, :]
            pair = tl.where(lo_half, offs_d, offs_d - HALF)
            cs_off = rows[:, None].to(tl.int64) * HALF + pair[None, :]
            cs_mask = row_ok & in_rot[None, :]
            cos = tl.load(cos_ptr + cs_off, mask=cs_mask, other=1.0)
            sin = tl.load(sin_ptr + cs_off, mask=cs_mask, other=0.0)
            rot_x = tl.where(lo_half[None, :], x * cos - xp * sin, xp * sin + x * cos)
            x = tl.where(in_rot[None, :], rot_x, x)
        tl.store(kf_ptr + rows[:, None].to(tl.int64) * (H * D) + h * D + offs_d[None, :], x, mask=row_ok)
        x = tl.where(mask, x, 0.0)
    else:
        x = tl.load(x_row + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_CENTRE:
        x = x - tl.load(centre_ptr + h * D + offs_d, mask=d_ok, other=0.0)[None, :]
    if ROTATED:  # y = x @ R^T, R [D, D] (rotate(x) = R x)
        r = tl.load(rot_ptr + offs_d[None, :] * D + offs_d[:, None],
                    mask=d_ok[None, :] & d_ok[:, None], other=0.0)  # r[j, i] = R[i, j]
        x = tl.dot(x, r, input_precision="tf32x3")  # fp32-accurate, tensor cores (ieee spills)

    slot64 = tl.where(keep, slot, 0).to(tl.int64)
    blk = slot64 // BS
    base = blk * BLOCK_BYTES + ((slot64 % BS) * H + h) * ROW_DATA  # [BLOCK_T]
    sbase = blk * BLOCK_BYTES + DATA_END + ((slot64 % BS) * H + h) * ROW_SCALE

    NG: tl.constexpr = BLOCK_D // GROUP
    offs_g = tl.arange(0, NG)
    g_ok = offs_g < D // GROUP
    gmask = keep[:, None] & g_ok[None, :]

    if ENCODE == _ENC_BF16:
        code = bf16_bits(x)
    elif ENCODE == _ENC_E4M3:
        if SCALE_KIND == _SCALE_TENSOR:  # fp8: one fp32 scale per layer and side
            code = e4m3_bits(tl.math.div_rn(x, tl.load(tscale_ptr) + tl.zeros_like(x)))
        else:  # turbo8: bf16 scale amax / 448 per group
            xg = tl.reshape(x, (BLOCK_T, NG, GROUP))
            amax = tl.max(tl.abs(xg), axis=2)
            scale = bf16_round(tl.math.div_rn(amax, 448.0 + tl.zeros_like(amax)))
            safe = tl.where(scale > 0, scale, 1.0)
            code = tl.reshape(e4m3_bits(tl.math.div_rn(xg, safe[:, :, None] + tl.zeros_like(xg))),
                              (BLOCK_T, BLOCK_D))
            sbits = bf16_bits(scale)
    elif ENCODE == _ENC_INT:  # llama.cpp q8_0 / q4_0
        xg = tl.reshape(x, (BLOCK_T, NG, GROUP))
        ax = tl.abs(xg)
        amax = tl.max(ax, axis=2)
        if BITS == 8:
            dq = tl.minimum(tl.math.div_rn(amax, 127.0 + tl.zeros_like(amax)), 65504.0)  # saturate
            dq = dq.to(tl.float16).to(tl.float32)
            safe = tl.where(dq > 0, dq, 1.0)
            q = round_half_even(tl.math.div_rn(xg, safe[:, :, None] + tl.zeros_like(xg)))
            q = tl.minimum(tl.maximum(q, -127.0), 127.0)
            code = tl.reshape(q.to(tl.int32) & 255, (BLOCK_T, BLOCK_D))
        else:  # q4_0's rule at BITS bits: d = m / -2**(BITS-1), u = floor(x / d + 2**(BITS-1) + 0.5)
            HALFQ: tl.constexpr = 1 << (BITS - 1)
            gi = tl.arange(0, GROUP)[None, None, :]
            first = tl.min(tl.where(ax == amax[:, :, None], gi, GROUP), axis=2)
            m = tl.sum(tl.where(gi == first[:, :, None], xg, 0.0), axis=2)
            dq = tl.math.div_rn(m, -1.0 * HALFQ + tl.zeros_like(m))
            dq = tl.minimum(tl.maximum(dq, -65504.0), 65504.0).to(tl.float16).to(tl.float32)
            safe = tl.where(dq != 0, dq, 1.0)
            u = tl.floor(tl.math.div_rn(xg, safe[:, :, None] + tl.zeros_like(xg)) + (HALFQ + 0.5))
            u = tl.minimum(tl.maximum(u, 0.0), 2.0 * HALFQ - 1.0)
            code = tl.reshape(u.to(tl.int32), (BLOCK_T, BLOCK_D))
        sbits = fp16_bits(dq)
    else:  # nearest level with the E4M3 group-scale search (nvfp4, turbo2/3/4/5)
        tl.static_assert(ENCODE == _ENC_TABLE, "unknown ENCODE constexpr (spec.py derives it)")
        xg = tl.reshape(x, (BLOCK_T, NG, GROUP))
        amax = tl.max(tl.abs(xg), axis=2)
        base_code = e4m3_bits(tl.math.div_rn(amax, MAX_LEVEL + tl.zeros_like(amax)))
        best_err = tl.full((BLOCK_T, NG), float("inf"), tl.float32)
        best_code = tl.zeros((BLOCK_T, NG), tl.int32)
        best_idx = tl.zeros((BLOCK_T, NG, GROUP), tl.int32)
        for k in range(SEARCH_N):  # a loop, not unrolled: keeps compile time down
            cb = tl.minimum(tl.maximum(base_code + (SEARCH_LO + k), 1), 0x7E)
            cand = e4m3_value(cb)  # [BLOCK_T, NG]
            y = tl.math.div_rn(xg, cand[:, :, None] + tl.zeros_like(xg))
            idx = tl.zeros((BLOCK_T, NG, GROUP), tl.int32)
            for j in tl.static_range(N_MIDS):
                idx += (y > tl.load(mids_ptr + j)).to(tl.int32)
            diff = xg - tl.load(levels_ptr + idx) * cand[:, :, None]
            err = tl.sum(diff * diff, axis=2)
            better = err < best_err
            best_err = tl.where(better, err, best_err)
            best_code = tl.where(better, cb, best_code)
            best_idx = tl.where(better[:, :, None], idx, best_idx)
        best_code = tl.where(amax == 0, 0, best_code)
        code = tl.reshape(tl.load(order_ptr + best_idx), (BLOCK_T, BLOCK_D))
        sbits = best_code

    # ---- codes: pack 8 at a time into BITS bytes (bf16: 2 bytes each) -------------------
    if BITS == 16:
        dst = pool_ptr + base[:, None] + offs_d[None, :] * 2
        tl.store(dst, (code & 255).to(tl.uint8), mask=mask)
        tl.store(dst + 1, ((code >> 8) & 255).to(tl.uint8), mask=mask)
    elif BITS == 8:
        tl.store(pool_ptr + base[:, None] + offs_d[None, :], code.to(tl.uint8), mask=mask)
    else:
        NW: tl.constexpr = BLOCK_D // 8
        shifts = (tl.arange(0, 8) * BITS).to(tl.int64)[None, None, :]
        words = tl.sum(tl.reshape(code, (BLOCK_T, NW, 8)).to(tl.int64) << shifts, axis=2)
        offs_w = tl.arange(0, NW)
        wmask = keep[:, None] & (offs_w < D // 8)[None, :]
        dst = pool_ptr + base[:, None] + offs_w[None, :] * BITS
        for k in tl.static_range(BITS):
            tl.store(dst + k, ((words >> (8 * k)) & 255).to(tl.uint8), mask=wmask)

    # ---- scales ---------------------------------------------------------------------------
    if ROW_SCALE > 0:
        SB: tl.constexpr = ROW_SCALE // (D // GROUP)
        sdst = pool_ptr + sbase[:, None] + offs_g[None, :] * SB
        tl.store(sdst, (sbits & 255).to(tl.uint8), mask=gmask)
        if SB == 2:
            tl.store(sdst + 1, ((sbits >> 8) & 255).to(tl.uint8), mask=gmask)


ROTATE_IN_KERNEL_MAX_D = 128  # larger head dims are rotated by one torch matmul before the kernel
SEARCH_LO, SEARCH_N = -5, 10  # the reference encoder's SCALE_SEARCH = range(-5, 5)


def store_side(layer: PagedLayer, codec, pool: torch.Tensor, tensor_scale: torch.Tensor,
               x: torch.Tensor, slot_mapping: torch.Tensor, centre: Optional[torch.Tensor],
               block_t: int = 16, prologue: Optional[dict] = None) -> None:
    """Encode x float [T, H, D] with `codec` into `pool` at `slot_mapping` (int64 [T], <0 skip).

    centre: optional float32 [H, D] subtracted first (k_centre or v_centre). prologue: the fused K path's extra
    kernel arguments (`fused.py`). Inputs are already validated.
    """
    t, h, d = x.shape
    if t == 0:
        return
    prologue = prologue or {}
    from ...codecs.reference import SCALE_SEARCH

    assert (SCALE_SEARCH.start, len(SCALE_SEARCH)) == (SEARCH_LO, SEARCH_N), SCALE_SEARCH
    spec = codec_spec(codec, layer.block_size, h, d, store=True)
    tabs = codec_tables(codec, x.device)
    slot_mapping = slot_mapping.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    rotate_in_kernel = codec.rotated and d <= ROTATE_IN_KERNEL_MAX_D
    if codec.rotated and not rotate_in_kernel:  # a D x D fp32 tile would not fit in shared memory
        assert not prologue, "the fused path rotates in the kernel (head_dim <= 128)"
        x = wht.rotate(x.float() - (centre if centre is not None else 0.0)).contiguous()
        centre = None
    rot = wht.rotation_matrix(d, x.device) if rotate_in_kernel else tabs.values
    block_d = max(16, triton.next_power_of_2(d))
    grid = (triton.cdiv(t, block_t), h)
    _store_kernel[grid](
        x, slot_mapping, pool, centre if centre is not None else tabs.values, rot,
        tabs.levels, tabs.mids, tabs.order, tensor_scale,
        t, pool.shape[0] * layer.block_size, x.stride(0), x.stride(1),
        H=h, D=d, BS=layer.block_size, BITS=spec.bits, GROUP=max(spec.group, 1),
        SCALE_KIND=spec.scale_kind, ROW_DATA=spec.row_data, ROW_SCALE=spec.row_scale,
        DATA_END=spec.data_end, BLOCK_BYTES=pool.stride(0), ENCODE=spec.encode,
        ROTATED=rotate_in_kernel, HAS_CENTRE=centre is not None,
        N_MIDS=max(spec.levels - 1, 0) if spec.encode == ENC_TABLE else 0,
        MAX_LEVEL=tabs.max_level, SEARCH_LO=SEARCH_LO, SEARCH_N=SEARCH_N,
        BLOCK_T=block_t, BLOCK_D=block_d, enable_fp_fusion=False, **prologue,
        num_warps=8 if spec.encode == ENC_TABLE or rotate_in_kernel else 4,  # fewer warps spill
    )


def store(layer: PagedLayer, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
          slot_mapping: torch.Tensor) -> None:
    """Triton twin of `pagedkv.ops.reference.store` (same signature and bytes; see module doc)."""
    if k is not None:
        store_side(layer, layer.k_codec, layer.k_pool, layer.k_scale, transform.keys_to_store(layer, k),
                   slot_mapping, layer.k_centre)
    if v is not None:
        store_side(layer, layer.v_codec, layer.v_pool, layer.v_scale, v, slot_mapping, layer.v_centre)
