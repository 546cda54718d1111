"""Codecs: the catalogue of how one K or V tensor is stored, and its reference encode/decode."""

from .catalogue import CODECS, Codec, ScaleType, ValueKind, get_codec
from .reference import decode, encode, roundtrip

__all__ = ["CODECS", "Codec", "ScaleType", "ValueKind", "get_codec", "encode", "decode", "roundtrip"]
