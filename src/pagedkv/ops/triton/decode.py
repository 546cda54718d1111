"""Triton paged decode attention (split-K / flash-decoding) for every (K codec, V codec) pair.

Launch plan (one query token per sequence):
1. `_decode_kernel`, grid (B, num_kv_heads, NUM_SPLITS): program (b, h, s) takes the s-th slice
   of sequence b's visible keys (the whole context, or the last W with a sliding window), reads
   K and V codes through the block table tile by tile (BLOCK_N tokens), decodes them in
   registers (`common.load_rows`) and runs an fp32 online softmax for the G query heads of kv
   head h at once (GQA), writing a partial (max, sum, unnormalised output).
2. `_reduce_kernel`, grid (B, Hq): merges the partials, adds the sink logit to the denominator,
   normalises.

Rotation bookends: q is rotated once before the kernel when K is stored rotated; the output is
un-rotated once after the reduce when V is; q . k_centre is added to every logit (a per-row
bias computed once). The per-layer transform (`pagedkv.ops.transform`): q is divided by k_mult
first; with v_centre the reduce also writes each row's token-weight sum W (sinks excluded) and
v_centre * W is added after the un-rotation. All accumulation is fp32.

Sparse V (threshold t > 0) needs each weight's final value, which split-K only knows after the
reduce, so it runs the same kernels twice: PASS 1 reads only K to get the partial statistics,
the reduce merges them (MODE 1), PASS 2 recomputes the logits, keeps p_j >= t and reads V only
for tokens that some head of the group keeps (masked loads: skipped rows cost no bandwidth),
and the reduce sums (MODE 2). The kept weights are not renormalised (reference semantics).

V_IS_K (`values_are_keys`: V is read from K's very bytes, as in a latent (MLA) layer's one-codec
rows `[latent | rope]`): the decoded K tile serves as V, so no row is read or decoded twice.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...codecs import wht
from ...errors import ConfigError
from .. import transform
from ..batch import AttentionParams, PagedLayer
from .common import dot, load_rows, soft_cap_logits
from .spec import codec_spec, codec_tables


@triton.jit
def _qk(q, k, DOT: tl.constexpr):
    """Logits q [G, D] . k [N, D] -> [G, N] fp32. "fma": exact fp32 products on the G real rows
    only (tl.dot would pad G to 16 rows: 4x the FMAs at GQA 4); otherwise tensor-core tl.dot."""
    if DOT == "fma":
        return tl.sum(q[:, None, :] * k[None, :, :], axis=2)
    else:
        return dot(q, tl.trans(k), DOT)


@triton.jit
def _pv(p, v, DOT: tl.constexpr):
    """p [G, N] @ v [N, D] -> [G, D] fp32 (see _qk)."""
    if DOT == "fma":
        return tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    else:
        return dot(p, v, DOT)


@triton.jit
def _decode_kernel(q_ptr, qc_ptr, k_pool, v_pool, k_tab, v_tab, k_ts_ptr, v_ts_ptr,
                   bt_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr, gm_ptr, gz_ptr,
                   bt_stride, bt_width, num_blocks, scale, soft_cap, window, threshold,
                   NUM_SPLITS: tl.constexpr, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                   BS: tl.constexpr,
                   K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_SCALE_KIND: tl.constexpr, K_VALUES: tl.constexpr,
                   K_ROW_DATA: tl.constexpr, K_ROW_SCALE: tl.constexpr, K_DATA_END: tl.constexpr,
                   K_BLOCK_BYTES: tl.constexpr,
                   V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_SCALE_KIND: tl.constexpr, V_VALUES: tl.constexpr,
                   V_ROW_DATA: tl.constexpr, V_ROW_SCALE: tl.constexpr, V_DATA_END: tl.constexpr,
                   V_BLOCK_BYTES: tl.constexpr,
                   HAS_QC: tl.constexpr, SOFT_CAP: tl.constexpr, WINDOW: tl.constexpr,
                   PASS: tl.constexpr, DOT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, V_IS_K: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    HQ: tl.constexpr = H * G
    n = tl.load(lens_ptr + b)
    lo = 0
    if WINDOW:
        lo = tl.maximum(n - window, 0)
    part = tl.cdiv(tl.cdiv(n - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * part
    end = tl.minimum(n, start + part)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < G
    d_ok = offs_d < D
    row = b * HQ + kvh * G + offs_g  # [BLOCK_G] index into [B, Hq]
    q = tl.load(q_ptr + row[:, None] * D + offs_d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if HAS_QC:
        qc = tl.load(qc_ptr + row, mask=g_ok, other=0.0)
    k_ts = tl.load(k_ts_ptr)
    v_ts = tl.load(v_ts_ptr)
    if PASS == 2:
        gm = tl.load(gm_ptr + row, mask=g_ok, other=0.0)
        gz = tl.load(gz_ptr + row, mask=g_ok, other=1.0)

    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for t in range(start, end, BLOCK_N):
        pos = t + offs_n
        p_ok = (pos < end) & (pos // BS < bt_width)  # never past the table row
        page = tl.load(bt_ptr + b.to(tl.int64) * bt_stride + pos // BS, mask=p_ok, other=0).to(tl.int64)
        page = tl.minimum(tl.maximum(page, 0), num_blocks - 1)  # never past the pool (checks=False)
        srow = (pos % BS) * H + kvh
        k = load_rows(k_pool, k_tab, k_ts, page * K_BLOCK_BYTES + srow * K_ROW_DATA,
                      page * K_BLOCK_BYTES + K_DATA_END + srow * K_ROW_SCALE, p_ok,
                      D, BLOCK_D, K_BITS, K_GROUP, K_SCALE_KIND, K_VALUES)
        s = _qk(q, k, DOT)  # [BLOCK_G, BLOCK_N] fp32
        if HAS_QC:
            s = s + qc[:, None]
        s = s * scale
        if SOFT_CAP:
            s = soft_cap_logits(s, soft_cap)
        s = tl.where(p_ok[None, :], s, float("-inf"))
        v_off = page * V_BLOCK_BYTES + srow * V_ROW_DATA
        v_soff = page * V_BLOCK_BYTES + V_DATA_END + srow * V_ROW_SCALE
        if PASS == 2:
            p = tl.exp(s - gm[:, None]) / gz[:, None]
            p = tl.where((p >= threshold) & g_ok[:, None], p, 0.0)
            if V_IS_K:  # the values are the keys already in registers (dropped weights are 0)
                acc += _pv(p, k, DOT)
            else:
                need = tl.max(p, axis=0) > 0  # [BLOCK_N]: some head of the group keeps the token
                v = load_rows(v_pool, v_tab, v_ts, v_off, v_soff, need, D, BLOCK_D,
                              V_BITS, V_GROUP, V_SCALE_KIND, V_VALUES)
                acc += _pv(p, v, DOT)
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if PASS == 0:
                if V_IS_K:
                    acc = acc * alpha[:, None] + _pv(p, k, DOT)
                else:
                    v = load_rows(v_pool, v_tab, v_ts, v_off, v_soff, p_ok, D, BLOCK_D,
                                  V_BITS, V_GROUP, V_SCALE_KIND, V_VALUES)
                    acc = acc * alpha[:, None] + _pv(p, v, DOT)
            m_i = m_new

    part_row = row * NUM_SPLITS + split
    if PASS != 2:
        tl.store(m_ptr + part_row, m_i, mask=g_ok)
        tl.store(l_ptr + part_row, l_i, mask=g_ok)
    if PASS != 1:
        tl.store(acc_ptr + part_row[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _reduce_kernel(m_ptr, l_ptr, acc_ptr, sinks_ptr, lens_ptr, out_ptr, gm_ptr, gz_ptr, w_ptr,
                   HQ: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, MODE: tl.constexpr,
                   HAS_SINKS: tl.constexpr, WANT_W: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """MODE 0: merge partials into the output; 1: merge statistics only (sparse V, to gm/gz);
    2: sum the already-normalised partial outputs (sparse V). WANT_W (modes 0 and 1): also write
    the row's token-weight sum sum_j p_j (the sinks' weight excluded; 0 for an empty row)."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    row = b * HQ + hq
    n = tl.load(lens_ptr + b)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < D
    amask = s_ok[:, None] & d_ok[None, :]
    if MODE == 2:
        acc = tl.load(acc_ptr + (row * NUM_SPLITS + offs_s)[:, None] * D + offs_d[None, :], mask=amask, other=0.0)
        out = tl.sum(acc, axis=0)
    else:
        m = tl.load(m_ptr + row * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
        l = tl.load(l_ptr + row * NUM_SPLITS + offs_s, mask=s_ok, other=0.0)
        mx = tl.max(m, axis=0)
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + hq)
            mx = tl.maximum(mx, sink)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        w = tl.exp(m - mx)  # empty partitions (m = -inf) weigh 0
        z = tl.sum(w * l, axis=0)
        zt = z
        if HAS_SINKS:
            z += tl.exp(sink - mx)
        if WANT_W:
            tl.store(w_ptr + row, zt / tl.where(z > 0, z, 1.0))
        if MODE == 1:
            tl.store(gm_ptr + row, mx)
            tl.store(gz_ptr + row, tl.where(z > 0, z, 1.0))
        else:
            acc = tl.load(acc_ptr + (row * NUM_SPLITS + offs_s)[:, None] * D + offs_d[None, :], mask=amask, other=0.0)
            out = tl.sum(acc * w[:, None], axis=0) / tl.where(z > 0, z, 1.0)
    if MODE != 1:
        out = tl.where(n > 0, out, 0.0)
        tl.store(out_ptr + row * D + offs_d, out, mask=d_ok)


PRECISIONS = ("fp32", "tf32", "bf16")


def check_precision(precision: str) -> str:
    """Validate a precision name; returns the DOT constexpr of the tl.dot calls (common.dot):
    fp32 -> "tf32x3" (fp32-accurate products on tensor cores; exact "ieee" FMA dots of big tiles
    spill registers), bf16 -> "bf16-emulated" under the interpreter (see common.dot)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "bf16" and type(_decode_kernel).__name__ == "InterpretedFunction":
        return "bf16-emulated"
    return "tf32x3" if precision == "fp32" else precision


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_splits_for(batch: int, num_kv_heads: int, max_context: int, block_n: int, device: torch.device) -> int:
    """Context partitions per (sequence, kv head): enough programs to fill the device (~4 per SM),
    never more than there are BLOCK_N tiles, at most 64."""
    tiles = max(1, -(-max_context // block_n))
    if device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        want = -(-4 * sms // max(batch * num_kv_heads, 1))
    else:  # the interpreter: a couple of splits keep the split-K path exercised
        want = 2
    return int(max(1, min(want, tiles, 64)))


def prepare_query(q: torch.Tensor, layer: PagedLayer):
    """(q / k_mult in the K basis, fp32 contiguous; (q / k_mult) . k_centre float32 [..., Hq] or
    None)."""
    qf = transform.query_for_keys(layer, q)
    qk = wht.rotate(qf) if layer.k_codec.rotated else qf
    qc = None
    if layer.k_centre is not None:
        h, d = layer.num_kv_heads, layer.head_dim
        g = q.shape[-2] // h
        qc = torch.einsum("...hgd,hd->...hg", qf.reshape(*q.shape[:-2], h, g, d), layer.k_centre)
        qc = qc.reshape(*q.shape[:-1]).contiguous()
    return qk.contiguous(), qc


def values_are_keys(layer: PagedLayer) -> bool:
    """True when V is read from the very bytes K is (same pool view, codec and tensor scale), as
    in a latent (MLA) layer whose one-codec rows `[latent | rope]` serve as keys and values: the
    kernels then reuse the decoded K tile as V (constexpr V_IS_K) instead of reading it again."""
    k, v = layer.k_pool, layer.v_pool
    return (layer.k_codec == layer.v_codec and k.data_ptr() == v.data_ptr()
            and k.shape == v.shape and k.stride() == v.stride()
            and (layer.k_scale is layer.v_scale or bool(torch.equal(layer.k_scale, layer.v_scale))))


def side_args(layer: PagedLayer, device: torch.device):
    """Value tables and constexprs of the K and V sides. A block's pitch in its pool is the pool's
    row stride (a pool may be a view with padded rows; elements within a row are contiguous)."""
    bs, h, d = layer.block_size, layer.num_kv_heads, layer.head_dim
    ks, vs = codec_spec(layer.k_codec, bs, h, d), codec_spec(layer.v_codec, bs, h, d)
    kt, vt = codec_tables(layer.k_codec, device), codec_tables(layer.v_codec, device)
    consts = {**ks.constexprs("K_"), **vs.constexprs("V_"),
              "K_BLOCK_BYTES": layer.k_pool.stride(0), "V_BLOCK_BYTES": layer.v_pool.stride(0)}
    return kt.values, vt.values, consts


def decode_attention(q: torch.Tensor, layer: PagedLayer, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, params: AttentionParams, *, block_n: int | None = None,
                     num_splits: int | None = None, precision: str = "fp32") -> torch.Tensor:
    """Triton twin of `pagedkv.ops.reference.decode_attention`: q [B, Hq, D] -> [B, Hq, D] (q's dtype).

    block_n: tokens per tile (None: sized so the fp32 [G, block_n, D] product tile stays in
    registers with exact fp32 products, 32 with tensor cores); num_splits: context partitions per sequence (None: from the
    device's SM count); precision: operands of the two matmuls, "fp32" (exact fp32 FMAs, the
    default), "tf32" or "bf16" (tensor cores); accumulation is fp32 in every case.
    Inputs are already validated by `pagedkv.ops.api`.
    """
    dot_kind = check_precision(precision)
    bsz, hq, d = q.shape
    h = layer.num_kv_heads
    g = hq // h
    dev = q.device
    out = torch.zeros(bsz, hq, d, dtype=torch.float32, device=dev)
    if bsz == 0:
        return out.to(q.dtype)
    qk, qc = prepare_query(q, layer)
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()  # kernels assume unit strides
    k_tab, v_tab, consts = side_args(layer, dev)
    max_ctx = block_tables.shape[1] * layer.block_size
    if params.sliding_window is not None:
        max_ctx = min(max_ctx, params.sliding_window)
    # exact fp32 FMAs on the real GQA rows where tl.dot would pad them to 16. With 16+ heads on a
    # KV head (MQA, latent rows) nothing is padded, and the [16, 8, 128] FMA tile gave wrong
    # outputs on an H200 (docs/gpu.md): tensor cores there (3xTF32 for fp32), except for rows
    # wider than 128, where those tiles spill at sm_90 and 8-key FMA tiles do not
    block_d = max(16, triton.next_power_of_2(d))
    fma = precision == "fp32" and (g < 16 or block_d > 128)
    block_g = triton.next_power_of_2(g) if fma else max(16, triton.next_power_of_2(g))
    if block_n is None:
        block_n = max(8 if block_g >= 16 else 16, min(64, 8192 // (block_g * block_d))) if fma else 32
    splits = num_splits or num_splits_for(bsz, h, max_ctx, block_n, dev)
    m = torch.empty(bsz, hq, splits, dtype=torch.float32, device=dev)
    l = torch.empty_like(m)
    acc = torch.empty(bsz, hq, splits, d, dtype=torch.float32, device=dev)
    gm = torch.empty(bsz, hq, dtype=torch.float32, device=dev)
    gz = torch.empty_like(gm)
    sinks = params.sinks.to(dev, torch.float32).contiguous() if params.sinks is not None else gm
    common = dict(
        NUM_SPLITS=splits, H=h, G=g, D=d, BS=layer.block_size, HAS_QC=qc is not None,
        SOFT_CAP=params.soft_cap is not None, WINDOW=params.sliding_window is not None,
        BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, DOT="fma" if fma else dot_kind,
        V_IS_K=values_are_keys(layer), **consts,
    )
    common["num_warps"] = 8 if fma and block_g * block_n * block_d >= 8192 else 4  # no spills at sm_90
    args = (qk, qc if qc is not None else gm, layer.k_pool, layer.v_pool, k_tab, v_tab,
            layer.k_scale, layer.v_scale, block_tables, seq_lens, m, l, acc, gm, gz,
            block_tables.stride(0), block_tables.shape[1], layer.num_blocks, float(params.scale), float(params.soft_cap or 1.0),
            int(params.sliding_window or 0), float(params.sparse_v_threshold))
    want_w = layer.v_centre is not None
    wsum = torch.zeros(bsz, hq, dtype=torch.float32, device=dev) if want_w else gm
    rargs = dict(HQ=hq, D=d, NUM_SPLITS=splits, HAS_SINKS=params.sinks is not None, WANT_W=want_w,
                 BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d)
    grid, rgrid = (bsz, h, splits), (bsz, hq)
    if params.sparse_v_threshold > 0:
        _decode_kernel[grid](*args, PASS=1, **common)
        _reduce_kernel[rgrid](m, l, acc, sinks, seq_lens, out, gm, gz, wsum, MODE=1, **rargs)
        _decode_kernel[grid](*args, PASS=2, **common)
        _reduce_kernel[rgrid](m, l, acc, sinks, seq_lens, out, gm, gz, wsum, MODE=2, **rargs)
    else:
        _decode_kernel[grid](*args, PASS=0, **common)
        _reduce_kernel[rgrid](m, l, acc, sinks, seq_lens, out, gm, gz, wsum, MODE=0, **rargs)
    if layer.v_codec.rotated:
        out = wht.unrotate(out)
    if want_w:
        transform.add_value_centre(layer, out, wsum)
    return out.to(q.dtype)
