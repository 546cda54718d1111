"""CacheConfig: everything that fixes a paged cache's shape, validated once at construction.

Layers here are the model's *attention* layers, numbered 0..num_layers-1 (a hybrid model's
recurrent or MLP-only layers hold no KV and are not counted; the integration maps model layer
indices to these). Format names are parsed once, here; everything below sees `KVFormat` objects.

High-precision layers (opt-in: a format name means the same bytes everywhere, so `turbo3` is
turbo3 in every layer, as on the command line): `turbo3+hp` (N automatic), `turbo3+hp2` (N = 2)
or `high_precision_layers=N / "auto"` make the first and last N layers use `hp_format` (default q8_0:
a lower KL than bf16 layers on SmolLM2, at fewer bits; docs/quality.md) instead of the base
format; per side, the more precise of the two codecs is kept, so hp never lowers precision.
`high_precision_layers="auto"` picks N from the most aggressive K codec among the layers
(`codecs.derive.auto_high_precision_layers`, derived from the row: max(0, 6 - code bits), so
K >= 8 bits: 0, 4 bits: 2, 3 bits: 3, 2 bits: 4, 5 bits: 1; low-bit keys shift attention scores,
and the first and last layers are the most sensitive). 2N >= num_layers makes every layer high precision.

Capacity: `num_blocks`, or `memory_bytes` (blocks = memory_bytes // bytes of one block id summed
over every layer's K and V block; fp8's per-layer fp32 scales are outside the blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from hashlib import blake2b
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch

from ..codecs.derive import auto_high_precision_layers
from ..defaults import BLOCK_SIZE
from ..errors import ConfigError
from ..formats import KVFormat, parse_format
from ..spec import spec_and_arguments

if TYPE_CHECKING:
    from ..ops.latent_layer import LatentSpec
    from ..options import CacheOptions
    from ..spec import RecentWindow
    from .latent import LatentLayout

FormatSpec = Union[str, KVFormat]

@dataclass(frozen=True)
class LayerSpec:
    """One resolved cache layer: its dims, format, window and block sizes (bytes, per side)."""

    index: int
    num_kv_heads: int
    head_dim: int
    format: KVFormat
    sliding_window: Optional[int]
    high_precision: bool
    k_block_bytes: int
    v_block_bytes: int
    latent: Optional["LatentSpec"] = None  # set for latent (MLA) layers: one pool, v_block_bytes 0


def _pos_int(name: str, v, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {v!r}")


def _more_precise(a, b):
    """The codec of the two that keeps more information (code bits, then bits per element)."""
    return a if (a.code_bits, a.bits_per_element) >= (b.code_bits, b.bits_per_element) else b


@dataclass(frozen=True)
class CacheConfig:
    """Shape and capacity of a paged cache.

    num_layers, num_kv_heads, head_dim: the attention layers and their default dims.
    layer_dims: optional per-layer (num_kv_heads, head_dim), length num_layers.
    kv_format: a spec (`pagedkv.spec`: a format name or KVFormat, "name+hp" / "name+hpN" for
    high-precision layers, a last "+rRsS<codec>" recent window, a plan file) or one format per
    layer; after construction the KVFormat, or the tuple of per-layer formats.
    high_precision_layers: None (default: what the name says, 0 for a plain name), N >= 0 or
    "auto" (see module doc); hp_format: their format.
    block_size: tokens per block. num_blocks or memory_bytes: capacity (give exactly one).
    sliding_window: None, one W for every layer, or one (W or None) per layer. The engine cache
    keeps one block group per distinct window and releases the blocks no query can see any more
    (`reclaim_sliding`, default True; False keeps every token in one group, as a prefix store
    needs). Attention parameters are the caller's (`AttentionParams.sliding_window`).
    recent_window: None or a `spec.RecentWindow(R, codec)` (an int R = a bf16 tail; or named by
    the spec, not both unless they agree): every
    layer also keeps its last R tokens in the tail codec, in a block group of window R, and
    attention reads them from there (`ops.recent`). Part of the fingerprint.
    device: where the pools live. trace: record per-block events (off by default).
    model_id: identity mixed into prefix keys (with formats and dims, see `fingerprint`).
    key_centring: give every layer a `k_centre` (zeros until `PagedCache.configure_layer`).
    check_slots: `store` verifies every slot belongs to a block some sequence holds (a host
    sync for device tensors; turn off in production serving once the caller is trusted).
    options: a `pagedkv.options.CacheOptions` supplies block_size, hp_format, recent_window,
    reclaim_sliding, keep_window_prefixes and key_centring (None: on for a non-raw K codec),
    instead of those fields.
    latent: a `pagedkv.cache.latent.LatentLayout` makes every layer a latent (MLA) layer: one pool
    of [latent | rope] per token (num_kv_heads/head_dim/layer_dims are then ignored).
    grow_blocks: every block group's pool starts at `total_blocks` (a sliding one at most 16)
    and grows by doubling on demand without a limit (the transformers drop-in without
    max_tokens); False (default): the global pool is fixed, sliding ones grow up to it.
    keep_window_prefixes: the sliding groups (and the recent window's tail group) keep the
    blocks their window released while those stay cached, instead of cutting the pool back to
    what the sequences hold (`alloc.manager.GroupSpec.keep_cached`): a later prompt sharing a
    stored prompt's first blocks then hits as long a prefix as without the window (the hit
    needs the window's blocks at its end), at the price of the group's pool staying at its
    high-water mark (within the same cap); False (default): the memory is returned and such a
    hit is cut to the released blocks that happen to survive.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_format: Union[FormatSpec, Sequence[FormatSpec]] = "bf16"
    layer_dims: Optional[Sequence[tuple[int, int]]] = None
    high_precision_layers: Union[None, int, str] = None
    hp_format: FormatSpec = "q8_0"
    block_size: int = BLOCK_SIZE
    num_blocks: Optional[int] = None
    memory_bytes: Optional[int] = None
    sliding_window: Union[None, int, Sequence[Optional[int]]] = None
    device: Union[str, torch.device] = "cpu"
    trace: bool = False
    model_id: str = ""
    key_centring: bool = False
    check_slots: bool = True
    latent: Optional["LatentLayout"] = None
    recent_window: Optional["RecentWindow"] = None
    reclaim_sliding: bool = True
    options: Optional["CacheOptions"] = None
    grow_blocks: bool = False
    keep_window_prefixes: bool = False
    layers: tuple[LayerSpec, ...] = field(init=False, repr=False, compare=False)
    num_high_precision_layers: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _set = object.__setattr__
        if self.options is not None:
            self._take_options()
        _pos_int("num_layers", self.num_layers)
        _pos_int("num_kv_heads", self.num_kv_heads)
        _pos_int("head_dim", self.head_dim)
        _pos_int("block_size", self.block_size)
        L = self.num_layers

        # dims
        if self.layer_dims is None:
            dims = ((self.num_kv_heads, self.head_dim),) * L
        else:
            dims = tuple(tuple(d) for d in self.layer_dims)
            if len(dims) != L:
                raise ConfigError(f"layer_dims has {len(dims)} entries, num_layers is {L}")
            for i, d in enumerate(dims):
                if len(d) != 2:
                    raise ConfigError(f"layer_dims[{i}] must be (num_kv_heads, head_dim), got {d!r}")
                _pos_int(f"layer_dims[{i}] num_kv_heads", d[0])
                _pos_int(f"layer_dims[{i}] head_dim", d[1])
            _set(self, "layer_dims", dims)

        # the spec, parsed once (`pagedkv.spec`: one format or one per layer, a "+hp" suffix, a
        # last "+r..." window, a plan file checked against the dims), merged with the arguments
        spec = spec_and_arguments(self.kv_format, self.high_precision_layers, self.recent_window)
        base = spec.layer_formats(L, dims)
        _set(self, "kv_format", spec.format if spec.layers is None else spec.layers)
        _set(self, "high_precision_layers", 0 if spec.high_precision_layers is None else spec.high_precision_layers)
        _set(self, "recent_window", spec.recent_window)
        hp_fmt = parse_format(self.hp_format)
        _set(self, "hp_format", hp_fmt)

        n_hp = self.high_precision_layers
        if n_hp == "auto":
            n_hp = max(auto_high_precision_layers(f.k) for f in base)
        hp_set = set(range(min(n_hp, L))) | set(range(max(L - n_hp, 0), L))

        # sliding windows
        sw = self.sliding_window
        if sw is None or isinstance(sw, int):
            _pos_int("sliding_window", sw, allow_none=True)
            windows = (sw,) * L
        else:
            windows = tuple(sw)
            if len(windows) != L:
                raise ConfigError(f"sliding_window has {len(windows)} entries, num_layers is {L}")
            for i, w in enumerate(windows):
                _pos_int(f"sliding_window[{i}]", w, allow_none=True)
            _set(self, "sliding_window", windows)

        # capacity and device
        try:
            _set(self, "device", torch.device(self.device))
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"device {self.device!r} is not a torch device: {exc}") from None
        if not isinstance(self.trace, bool):
            raise ConfigError(f"trace must be a bool, got {self.trace!r}")
        if not isinstance(self.model_id, str):
            raise ConfigError(f"model_id must be a str, got {self.model_id!r}")

        for name in ("reclaim_sliding", "keep_window_prefixes"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.recent_window is not None and self.latent is not None:
            raise ConfigError("a recent window is not implemented for latent (MLA) layers")
        if self.latent is not None:
            from .latent import LatentLayout
            if not isinstance(self.latent, LatentLayout):
                raise ConfigError(f"latent must be None or a LatentLayout, got {self.latent!r}")
            if self.key_centring:  # the latent is both key and value: a centre is not exact
                raise ConfigError("key_centring=True is for K/V layers; latent (MLA) layers store "
                                  "the latent as it is (use key_centring=False)")
        specs = []
        for i in range(L):
            h, d = dims[i]
            f = base[i]
            if i in hp_set:
                f = KVFormat(_more_precise(hp_fmt.k, f.k), _more_precise(hp_fmt.v, f.v))
            if self.latent is not None:
                ls = self.latent.spec(f)
                specs.append(LayerSpec(
                    index=i, num_kv_heads=1, head_dim=ls.elements, format=f,
                    sliding_window=windows[i], high_precision=i in hp_set,
                    k_block_bytes=ls.block_bytes(self.block_size), v_block_bytes=0, latent=ls))
                continue
            f.check_head_dim(d)
            if self.recent_window is not None:  # the tail stores the same rows in its codec
                self.recent_window.codec.check_head_dim(d)
            specs.append(LayerSpec(
                index=i, num_kv_heads=h, head_dim=d, format=f, sliding_window=windows[i],
                high_precision=i in hp_set,
                k_block_bytes=f.k_block_bytes(self.block_size, h, d),
                v_block_bytes=f.v_block_bytes(self.block_size, h, d),
            ))
        _set(self, "layers", tuple(specs))
        _set(self, "num_high_precision_layers", min(n_hp, L))
        self._options_key_centring()

        if (self.num_blocks is None) == (self.memory_bytes is None):
            raise ConfigError(
                "give exactly one of num_blocks or memory_bytes, got "
                f"num_blocks={self.num_blocks!r}, memory_bytes={self.memory_bytes!r}"
            )
        if self.num_blocks is not None:
            _pos_int("num_blocks", self.num_blocks)
        else:
            _pos_int("memory_bytes", self.memory_bytes)
            if self.memory_bytes // self.bytes_per_block == 0:
                raise ConfigError(
                    f"memory_bytes={self.memory_bytes} is less than one block "
                    f"({self.bytes_per_block} bytes over all layers, K and V)"
                )

    def _take_options(self) -> None:
        """Fill the fields a `CacheOptions` declares (block_size, hp_format, recent_window,
        reclaim_sliding, keep_window_prefixes, key_centring: None = on for a non-raw K codec)
        from `options`; a field also given here (not at its default) is refused."""
        from ..options import CacheOptions

        opts = self.options
        if not isinstance(opts, CacheOptions):
            raise ConfigError(f"options must be a pagedkv.options.CacheOptions, got {opts!r}")
        taken = ("block_size", "hp_format", "recent_window", "reclaim_sliding", "keep_window_prefixes",
                 "key_centring")
        defaults = {f.name: f.default for f in fields(CacheConfig)}
        both = [n for n in taken if getattr(self, n) != defaults[n]]
        if both:
            raise ConfigError(f"{', '.join(both)}: given both as a field and in options; give them once")
        for name in taken[:-1]:
            object.__setattr__(self, name, getattr(opts, name))
        object.__setattr__(self, "key_centring", bool(opts.key_centring))  # None: see the end

    def _options_key_centring(self) -> None:
        """`options.key_centring` None: on when some layer's K codec (after the high-precision
        policy) is not raw, as in every front door."""
        from ..options import default_key_centring

        if self.options is not None and self.options.key_centring is None and self.latent is None:
            object.__setattr__(self, "key_centring", default_key_centring(self.layer_formats))

    # ---- derived ----------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id takes, summed over every layer's K and V block."""
        return sum(s.k_block_bytes + s.v_block_bytes for s in self.layers)

    @property
    def total_blocks(self) -> int:
        """Blocks in the pool (num_blocks, or memory_bytes // bytes_per_block)."""
        if self.num_blocks is not None:
            return self.num_blocks
        return self.memory_bytes // self.bytes_per_block

    @property
    def layer_formats(self) -> tuple[KVFormat, ...]:
        """The format of every layer after the high-precision policy."""
        return tuple(s.format for s in self.layers)

    @property
    def fingerprint(self) -> bytes:
        """16 bytes naming what a stored block means: model id, block size, every layer's dims
        and format, key centring and the recent window. Mixed into every prefix key (the fitted
        transform is added by the cache that fits it, see `transform_namespace`)."""
        parts = [f"pagedkv-cache-v1|{self.model_id}|bs={self.block_size}|kc={self.key_centring}"]
        if self.recent_window is not None:  # the tail changes what a stored sequence holds
            rw = self.recent_window
            parts.append(f"recent={rw.tokens}:{rw.codec.name}" + (f":s{rw.sinks}" if rw.sinks else ""))
        for s in self.layers:
            parts.append(f"{s.num_kv_heads}x{s.head_dim}:{s.format.name}"
                         + (f":latent{s.latent.latent_dim}+{s.latent.rope_dim}:{s.latent.name}"
                            if s.latent is not None else ""))
        return blake2b("|".join(parts).encode(), digest_size=16).digest()
