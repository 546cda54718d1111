"""The stored-block record: round trip, and every damaged / mismatched buffer is a miss."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.codecs import get_codec
from pagedkv.ops import make_layer, store
from pagedkv.offload.record import (BlockLayout, RecordError, decode_record, decode_section,
                                    encode_record, header_bytes, parse_header, read_block,
                                    record_size, section_span, section_views, try_decode_record,
                                    write_block)


def _layers(formats=(("turbo3", "turbo3"), ("bf16", "q4_0"), ("fp8", "turbo8")), nb=4, bs=8,
            h=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (kc, vc) in enumerate(formats):
        pl = make_layer(get_codec(kc), get_codec(vc), nb, bs, h, d, k_scale=0.5 + i, v_scale=2.0)
        t = nb * bs
        store(pl, torch.randn(t, h, d, generator=g), torch.randn(t, h, d, generator=g),
              torch.arange(t, dtype=torch.int64))
        out.append(pl)
    return out


@pytest.fixture(scope="module")
def layers():
    return _layers()


def test_round_trip_and_write_back(layers):
    layout = BlockLayout.from_layers(layers)
    key = b"some-key"
    sections = read_block(layers, 2)
    rec = encode_record(layout, key, sections)
    assert len(rec) == record_size(layout, key)
    assert decode_record(rec, layout, key) == sections
    head = parse_header(rec)
    assert head.key == key and head.layout == layout and head.header_len == len(header_bytes(layout, key))
    # per-layer sections read alone verify too (and the copy-free hot path agrees)
    hd = header_bytes(layout, key)[-16:]
    for i, lay in enumerate(layout.layers):
        off, n = section_span(layout, key, i)
        assert decode_section(rec[off:off + n], layout, key, i) == sections[i]
        k, v = section_views(rec[off:off + n], hd, i, lay.k_bytes, lay.v_bytes)
        assert (bytes(k), bytes(v)) == sections[i]
        bad = bytearray(rec[off:off + n])
        bad[n // 2] ^= 4
        assert section_views(bytes(bad), hd, i, lay.k_bytes, lay.v_bytes) is None
        assert section_views(rec[off:off + n - 1], hd, i, lay.k_bytes, lay.v_bytes) is None
        assert section_views(rec[off:off + n], hd, (i + 1) % 3, lay.k_bytes, lay.v_bytes) is None
    # writing the bytes into another block reproduces it exactly, in every layer and side
    write_block(layers, 0, sections)
    for pl in layers:
        assert torch.equal(pl.k_pool[0], pl.k_pool[2]) and torch.equal(pl.v_pool[0], pl.v_pool[2])


def test_every_truncation_is_a_miss(layers):
    layout = BlockLayout.from_layers(layers)
    rec = encode_record(layout, b"k", read_block(layers, 1))
    cuts = sorted(set(range(0, 200)) | set(random.Random(0).sample(range(len(rec)), 200)))
    for cut in cuts:
        assert try_decode_record(rec[:cut], layout, b"k") is None, cut
    assert try_decode_record(rec + b"\0", layout, b"k") is None
    assert try_decode_record(None, layout, b"k") is None


def test_every_byte_flip_is_a_miss(layers):
    layout = BlockLayout.from_layers(layers)
    rec = bytearray(encode_record(layout, b"k", read_block(layers, 1)))
    positions = set(range(len(header_bytes(layout, b"k")))) | set(
        random.Random(1).sample(range(len(rec)), 300))
    for p in sorted(positions):
        bad = bytearray(rec)
        bad[p] ^= 1 << (p % 8)
        assert try_decode_record(bytes(bad), layout, b"k") is None, p


def test_mismatched_layout_or_key_is_a_miss(layers):
    layout = BlockLayout.from_layers(layers)
    rec = encode_record(layout, b"k", read_block(layers, 1))
    assert try_decode_record(rec, layout, b"other") is None
    # same shapes, different fp8 tensor scale: the bytes would mean other values
    rescaled = _layers()
    rescaled[2] = make_layer(get_codec("fp8"), get_codec("turbo8"), 4, 8, 2, 32, k_scale=9.0)
    assert try_decode_record(rec, BlockLayout.from_layers(rescaled), b"k") is None
    # a different format with the same byte counts is not accepted either
    other = _layers(formats=(("turbo3", "turbo3"), ("bf16", "nvfp4"), ("fp8", "turbo8")))
    assert BlockLayout.from_layers(other) != layout
    assert try_decode_record(rec, BlockLayout.from_layers(other), b"k") is None
    # a section from another record (other key) does not verify
    rec2 = encode_record(layout, b"k2", read_block(layers, 1))
    off, n = section_span(layout, b"k2", 0)
    with pytest.raises(RecordError):
        decode_section(rec2[off:off + n], layout, b"k", 0)


def test_key_centre_changes_the_layout():
    a = make_layer(get_codec("bf16"), get_codec("bf16"), 2, 8, 2, 32, k_centre=torch.zeros(2, 32))
    b = make_layer(get_codec("bf16"), get_codec("bf16"), 2, 8, 2, 32, k_centre=torch.ones(2, 32))
    assert BlockLayout.from_layers([a]) != BlockLayout.from_layers([b])


@pytest.mark.parametrize("field", ["k_centre", "k_mult", "v_centre", "k_scale", "v_scale"])
def test_every_part_of_the_transform_changes_the_layout(field):
    """Stored bytes mean something else under another transform: a record (and a prefix-store
    key, which mixes in the layout fingerprint) of one transform never matches another."""
    fp8 = get_codec("fp8")
    base = dict(k_centre=torch.zeros(2, 32), k_mult=torch.ones(2, 32), v_centre=torch.zeros(2, 32))
    a = make_layer(fp8, fp8, 2, 8, 2, 32, **base)
    if field in base:
        other = dict(base, **{field: base[field] + 0.5})
        b = make_layer(fp8, fp8, 2, 8, 2, 32, **other)
    else:
        b = make_layer(fp8, fp8, 2, 8, 2, 32, **base, **{field: 0.5})
    la, lb = BlockLayout.from_layers([a]), BlockLayout.from_layers([b])
    assert la != lb and la.fingerprint != lb.fingerprint


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_parse_header_of_garbage_raises_only_record_error(buf):
    try:
        parse_header(b"PKVB" + buf)
    except RecordError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_parse_header_of_damaged_header_raises_only_record_error(data):
    layout = BlockLayout.from_layers(_LAYERS)
    rec = bytearray(encode_record(layout, b"key", read_block(_LAYERS, 0)))
    n = len(header_bytes(layout, b"key"))
    for _ in range(data.draw(st.integers(1, 4))):
        p = data.draw(st.integers(0, n - 1))
        rec[p] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(rec)))
    try:
        head = parse_header(bytes(rec[:cut]))
    except RecordError:
        return
    # a header that still parses must be the original one (the checksum covers it)
    assert head.layout == layout and head.key == b"key"


_LAYERS = _layers(formats=(("turbo3", "bf16"),), nb=1)
