"""Triton paged prefill attention: chunked, causal (bottom-right), varlen, any codec pair.

Grid (query tiles, num_kv_heads). The packed queries of every sequence are cut into tiles of
BLOCK_Q tokens; a program finds its sequence by binary search over the cumulative tile counts
(computed on the device, no host sync) and treats BLOCK_Q tokens x G query heads of one kv head
as the rows of one tile (GQA: K and V are read once per group). Query j of sequence b sits at
position seq_lens[b] - q_len_b + j; keys run from 0 (or the window start) to the tile's last
query position, read through the block table and decoded in registers like decode. fp32 online
softmax; sinks start the running max / sum; sparse V (t > 0) makes a first pass over K for the
final statistics, then a second pass keeps p >= t and reads only the V rows someone keeps.
Rotation bookends, q . k_centre and the per-layer transform as in decode (with v_centre the
kernel writes each row's token-weight sum, sinks excluded, and the launcher adds v_centre times it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...codecs import wht
from .. import transform
from ..batch import AttentionParams, PagedLayer
from .common import dot, load_rows, soft_cap_logits
from .decode import check_precision, prepare_query, side_args, values_are_keys


@triton.jit
def _scores(q, qc, k_pool, k_tab, k_ts, bt_row_ptr, bt_width, num_blocks, kpos, qpos, row_ok, offs_d, d_ok,
            scale, soft_cap, window, H: tl.constexpr, BS: tl.constexpr, kvh, D: tl.constexpr,
            BLOCK_D: tl.constexpr,
            K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_SCALE_KIND: tl.constexpr, K_VALUES: tl.constexpr,
            K_ROW_DATA: tl.constexpr, K_ROW_SCALE: tl.constexpr, K_DATA_END: tl.constexpr,
            K_BLOCK_BYTES: tl.constexpr, HAS_QC: tl.constexpr, SOFT_CAP: tl.constexpr,
            WINDOW: tl.constexpr, DOT: tl.constexpr):
    """Masked logits [BLOCK_M, BLOCK_N] of the tile's queries against keys at `kpos`, and the
    keys' page ids / slot rows (for the V read), the decoded keys [BLOCK_N, BLOCK_D] and the
    keys' mask."""
    k_ok = (kpos <= tl.max(tl.where(row_ok, qpos, -1), axis=0)) & (kpos // BS < bt_width) & (kpos >= 0)
    page = tl.load(bt_row_ptr + kpos // BS, mask=k_ok, other=0).to(tl.int64)
    page = tl.minimum(tl.maximum(page, 0), num_blocks - 1)  # never past the pool (checks=False)
    srow = (kpos % BS) * H + kvh
    k = load_rows(k_pool, k_tab, k_ts, page * K_BLOCK_BYTES + srow * K_ROW_DATA,
                  page * K_BLOCK_BYTES + K_DATA_END + srow * K_ROW_SCALE, k_ok,
                  D, BLOCK_D, K_BITS, K_GROUP, K_SCALE_KIND, K_VALUES)
    s = dot(q, tl.trans(k), DOT)
    if HAS_QC:
        s = s + qc[:, None]
    s = s * scale
    if SOFT_CAP:
        s = soft_cap_logits(s, soft_cap)
    visible = (kpos[None, :] <= qpos[:, None]) & row_ok[:, None]
    if WINDOW:
        visible = visible & (kpos[None, :] > qpos[:, None] - window)
    s = tl.where(visible, s, float("-inf"))
    return s, page, srow, k, k_ok


@triton.jit
def _prefill_kernel(q_ptr, qc_ptr, k_pool, v_pool, k_tab, v_tab, k_ts_ptr, v_ts_ptr,
                    bt_ptr, lens_ptr, qsl_ptr, tiles_ptr, sinks_ptr, out_ptr, w_ptr,
                    bt_stride, bt_width, num_blocks, TQ, scale, soft_cap, window, threshold, B,
                    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                    BS: tl.constexpr,
                    K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_SCALE_KIND: tl.constexpr, K_VALUES: tl.constexpr,
                    K_ROW_DATA: tl.constexpr, K_ROW_SCALE: tl.constexpr, K_DATA_END: tl.constexpr,
                    K_BLOCK_BYTES: tl.constexpr,
                    V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_SCALE_KIND: tl.constexpr, V_VALUES: tl.constexpr,
                    V_ROW_DATA: tl.constexpr, V_ROW_SCALE: tl.constexpr, V_DATA_END: tl.constexpr,
                    V_BLOCK_BYTES: tl.constexpr,
                    HAS_QC: tl.constexpr, SOFT_CAP: tl.constexpr, WINDOW: tl.constexpr,
                    HAS_SINKS: tl.constexpr, WANT_W: tl.constexpr, SPARSE: tl.constexpr, SEARCH_STEPS: tl.constexpr, DOT: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    V_IS_K: tl.constexpr):
    tid = tl.program_id(0)
    kvh = tl.program_id(1)
    HQ: tl.constexpr = H * G
    BLOCK_M: tl.constexpr = BLOCK_Q * GP
    live = tid < tl.load(tiles_ptr + B)  # the grid over-covers the tiles; spare programs do nothing
    # the sequence owning tile `tid`: the largest b with tiles[b] <= tid
    lo = tid * 0
    hi = lo + B
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        ok = tl.load(tiles_ptr + mid) <= tid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    b = lo
    q0 = tl.load(qsl_ptr + b)
    q_len = tl.where(live, tl.load(qsl_ptr + b + 1) - q0, 0)
    n = tl.load(lens_ptr + b)
    local = tid - tl.load(tiles_ptr + b)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < D
    qi = local * BLOCK_Q + offs_m // GP
    g = offs_m % GP
    row_ok = (qi < q_len) & (g < G) & (q0 + qi < TQ) & (q0 + qi >= 0)  # inside q / out (checks=False)
    qpos = n - q_len + qi
    qrow = (q0 + qi).to(tl.int64) * HQ + kvh * G + g  # index into [Tq, Hq]
    q = tl.load(q_ptr + qrow[:, None] * D + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    qc = q_len * 0.0
    if HAS_QC:
        qc = tl.load(qc_ptr + qrow, mask=row_ok, other=0.0)
    k_ts = tl.load(k_ts_ptr)
    v_ts = tl.load(v_ts_ptr)
    bt_row = bt_ptr + b.to(tl.int64) * bt_stride

    first = n - q_len + local * BLOCK_Q
    k_end = n - q_len + tl.minimum(q_len, (local + 1) * BLOCK_Q)  # last query position + 1
    k_start = 0
    if WINDOW:
        k_start = tl.maximum(first - window + 1, 0)

    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + kvh * G + g, mask=g < G, other=0.0)
        l_i = tl.full((BLOCK_M,), 1.0, tl.float32)
    else:
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for t in range(k_start, k_end, BLOCK_N):
        kpos = t + offs_n
        s, page, srow, k, k_ok = _scores(q, qc, k_pool, k_tab, k_ts, bt_row, bt_width, num_blocks, kpos, qpos, row_ok,
                                         offs_d, d_ok, scale, soft_cap, window, H, BS, kvh, D, BLOCK_D,
                                         K_BITS, K_GROUP, K_SCALE_KIND, K_VALUES, K_ROW_DATA, K_ROW_SCALE,
                                         K_DATA_END, K_BLOCK_BYTES, HAS_QC, SOFT_CAP, WINDOW, DOT)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if not SPARSE:
            if V_IS_K:  # the values are the keys already in registers (latent rows)
                v = k
            else:
                v = load_rows(v_pool, v_tab, v_ts, page * V_BLOCK_BYTES + srow * V_ROW_DATA,
                              page * V_BLOCK_BYTES + V_DATA_END + srow * V_ROW_SCALE, k_ok,
                              D, BLOCK_D, V_BITS, V_GROUP, V_SCALE_KIND, V_VALUES)
            acc = acc * alpha[:, None] + dot(p, v, DOT)
        m_i = m_new
    if SPARSE:  # second pass: exact weights, keep p >= threshold, read only the kept V rows
        m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
        z = tl.where(l_i > 0, l_i, 1.0)
        for t in range(k_start, k_end, BLOCK_N):
            kpos = t + offs_n
            s, page, srow, k, k_ok = _scores(q, qc, k_pool, k_tab, k_ts, bt_row, bt_width, num_blocks, kpos, qpos, row_ok,
                                             offs_d, d_ok, scale, soft_cap, window, H, BS, kvh, D, BLOCK_D,
                                             K_BITS, K_GROUP, K_SCALE_KIND, K_VALUES, K_ROW_DATA, K_ROW_SCALE,
                                             K_DATA_END, K_BLOCK_BYTES, HAS_QC, SOFT_CAP, WINDOW, DOT)
            p = tl.exp(s - m_fin[:, None]) / z[:, None]
            p = tl.where(p >= threshold, p, 0.0)
            if V_IS_K:
                v = k
            else:
                need = (tl.max(p, axis=0) > 0) & k_ok
                v = load_rows(v_pool, v_tab, v_ts, page * V_BLOCK_BYTES + srow * V_ROW_DATA,
                              page * V_BLOCK_BYTES + V_DATA_END + srow * V_ROW_SCALE, need,
                              D, BLOCK_D, V_BITS, V_GROUP, V_SCALE_KIND, V_VALUES)
            acc += dot(p, v, DOT)
        out = acc
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if WANT_W:  # sum of the token weights: 1, less the sinks' weight exp(sink - m) / l
        wt = tl.where(l_i > 0, 1.0, 0.0)
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + kvh * G + g, mask=g < G, other=0.0)
            wt = 1.0 - tl.exp(sink - m_i) / tl.where(l_i > 0, l_i, 1.0)
        tl.store(w_ptr + qrow, wt, mask=row_ok)
    tl.store(out_ptr + qrow[:, None] * D + offs_d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])


def prefill_attention(q: torch.Tensor, layer: PagedLayer, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      params: AttentionParams, *, block_m: int | None = None, block_n: int | None = None,
                      precision: str = "fp32") -> torch.Tensor:
    """Triton twin of `pagedkv.ops.reference.prefill_attention`: q [Tq, Hq, D] -> [Tq, Hq, D].

    block_m: rows (query tokens x heads of a group) per tile (None: 64 with tf32/bf16 operands,
    32 with fp32 (3xTF32 needs more registers), 16 for head_dim > 128 or sparse V, whose two
    passes hold more state: sizes that compile without register spills at sm_90); block_n: keys per tile (None: 32, 16 with sparse V);
    precision: matmul operands as in `decode_attention`. Inputs are already validated by
    `pagedkv.ops.api`.
    """
    dot_kind = check_precision(precision)
    tq, hq, d = q.shape
    h = layer.num_kv_heads
    g = hq // h
    bsz = seq_lens.shape[0]
    dev = q.device
    out = torch.zeros(tq, hq, d, dtype=torch.float32, device=dev)
    if tq == 0 or bsz == 0:
        return out.to(q.dtype)
    qk, qc = prepare_query(q, layer)
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()  # kernels assume unit strides
    query_start_loc = query_start_loc.contiguous()
    k_tab, v_tab, consts = side_args(layer, dev)
    gp = triton.next_power_of_2(g)
    if block_m is None:
        block_m = 16 if d > 128 or params.sparse_v_threshold > 0 else 32 if precision == "fp32" else 64
    # V read from K's bytes (latent rows): reuse the decoded K tile up to 128 dims; wider, keeping
    # it live through the softmax spills registers at sm_90 (tests/triton_compile_check.py), so
    # V is read again (the same bytes, just read: a cache hit) with half-size key tiles, which
    # keep the shared memory of 192-dim rows with 16 heads per row under the sm_90 limit
    v_same = values_are_keys(layer)
    v_is_k = v_same and d <= 128
    if block_n is None:
        block_n = 16 if params.sparse_v_threshold > 0 or (v_same and d > 128) else 32
    block_m = max(block_m, gp, 16)
    block_q = block_m // gp
    block_d = max(16, triton.next_power_of_2(d))
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int32)
    tiles = torch.zeros(bsz + 1, dtype=torch.int32, device=dev)
    tiles[1:] = torch.cumsum((q_lens + block_q - 1) // block_q, 0)
    sinks = params.sinks.to(dev, torch.float32).contiguous() if params.sinks is not None else out
    want_w = layer.v_centre is not None
    wsum = torch.zeros(tq, hq, dtype=torch.float32, device=dev) if want_w else out
    grid = (triton.cdiv(tq, block_q) + bsz, h)
    _prefill_kernel[grid](
        qk, qc if qc is not None else out, layer.k_pool, layer.v_pool, k_tab, v_tab,
        layer.k_scale, layer.v_scale, block_tables, seq_lens, query_start_loc, tiles, sinks, out, wsum,
        block_tables.stride(0), block_tables.shape[1], layer.num_blocks, tq, float(params.scale), float(params.soft_cap or 1.0),
        int(params.sliding_window or 0), float(params.sparse_v_threshold), bsz,
        H=h, G=g, GP=gp, D=d, BS=layer.block_size, HAS_QC=qc is not None,
        SOFT_CAP=params.soft_cap is not None, WINDOW=params.sliding_window is not None,
        HAS_SINKS=params.sinks is not None, WANT_W=want_w, SPARSE=params.sparse_v_threshold > 0,
        SEARCH_STEPS=max(1, bsz.bit_length()), DOT=dot_kind, BLOCK_Q=block_q, BLOCK_N=block_n,
        BLOCK_D=block_d, V_IS_K=v_is_k, **consts, num_warps=8 if block_m * block_d >= 2048 else 4,
    )
    if layer.v_codec.rotated:
        out = wht.unrotate(out)
    if want_w:
        transform.add_value_centre(layer, out, wsum)
    return out.to(q.dtype)
