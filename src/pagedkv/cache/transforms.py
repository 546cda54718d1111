"""The layer transforms of one engine cache: what stored bytes mean, set, fitted, shared, reset.

A layer's transform (key centre and multipliers, value centre, fp8 scales; a latent layer's fp8
scales) is part of the layer the ops receive (`ops.batch.PagedLayer`, `ops.latent_layer`). It
may change only while no stored row depends on it:
- `configure` / `calibrate` (`PagedCache.configure_layer` / `calibrate_layer`): an empty cache;
  the prefix keys' namespace then covers the transforms (`storage.transform_namespace`);
- `fit` (`PagedCache.fit_layer`, a front door that fits each layer on its own first chunk while
  earlier layers already store it: the transformers drop-in): a layer not fitted and not stored
  into; the namespace stays (sequences hold their roots; a prefix store's keys cover the
  transform through the record layout);
- a latent layer's first store fits its fp8 scales (`cache/latent_plane.py`);
- `adopt_kv` / `adopt_latent`: a prefix store's transform record (`transform_record`) instead of
  fitting, while no layer is fitted;
- `reset`: back to the built transform.

`LayerTransforms` owns which layers are fixed (`fitted`) and which were stored into since their
last reset (`written`); the layers themselves are the storage's (`groups.GroupStorage`, their one
owner), replaced through its `set_layers`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from ..errors import ConfigError, InvalidInput
from ..ops.batch import PagedLayer
from . import storage
from .latent import LATENT_TRANSFORM_SHAPES, latent_transform, with_latent_transform

FIELDS = ("k_centre", "k_mult", "v_centre", "k_scale", "v_scale")


class LayerTransforms:
    """The transforms of the layers `storage` holds (see the module doc); `config` the cache's
    `CacheConfig`; `fit_first_chunk` as `PagedCache` takes it."""

    def __init__(self, storage, config, fit_first_chunk: bool = False):
        self.storage, self.config, self.fit_first_chunk = storage, config, bool(fit_first_chunk)
        self.fitted: frozenset = frozenset()  # layers whose transform is fixed (fitted or adopted)
        self.written: frozenset = frozenset()  # K/V layers stored into since their last reset

    def stored(self, layer: int) -> None:
        if layer not in self.written:
            self.written = self.written | {layer}

    def check_empty(self, what: str) -> None:
        if any(g.pool.num_used or g.pool.num_cached for g in self.storage.core.groups):
            raise ConfigError(
                f"{what} needs an empty cache (stored blocks were encoded with the old "
                "settings); call clear() first"
            )

    # ---- set and fit --------------------------------------------------------------------------
    def configure(self, layer: int, *, k_scale: Optional[float] = None, v_scale: Optional[float] = None,
                  k_centre: Optional[torch.Tensor] = None, k_mult: Optional[torch.Tensor] = None,
                  v_centre: Optional[torch.Tensor] = None) -> None:
        """Set a layer's transform (`PagedCache.configure_layer`): fp8 tensor scales, key centre
        (float32 [H, D]; needs CacheConfig(key_centring=True)), key channel multipliers and value
        centre (float32 [H, D]; see `PagedLayer`). Only while the cache holds no data (they
        change what stored bytes mean). The prefix keys' namespace then covers the transform
        (`storage.transform_namespace`): caches with different transforms share no prefix."""
        self.storage.kv(layer)
        self.check_empty("configure_layer")
        self._set(layer, self.validated(layer, k_scale=k_scale, v_scale=v_scale, k_centre=k_centre,
                                        k_mult=k_mult, v_centre=v_centre), namespace=True)

    def validated(self, layer: int, k_scale=None, v_scale=None, k_centre=None, k_mult=None,
                  v_centre=None) -> dict:
        """The validated PagedLayer fields of a transform (ConfigError / InvalidInput)."""
        c = self.storage
        pl = c.kv(layer)
        for name, val in (("k_scale", k_scale), ("v_scale", v_scale)):
            if val is not None and not (isinstance(val, (int, float)) and 0 < float(val) < float("inf")):
                raise ConfigError(f"{name} must be a finite number > 0, got {val!r}")
        changes = {}
        if k_centre is not None and not self.config.key_centring:
            raise ConfigError("k_centre needs CacheConfig(key_centring=True)")
        shape = (pl.num_kv_heads, pl.head_dim)
        for name, t in (("k_centre", k_centre), ("k_mult", k_mult), ("v_centre", v_centre)):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape \
                    or not torch.is_floating_point(t) or not bool(torch.isfinite(t).all()):
                raise InvalidInput(f"{name} must be a finite float tensor of shape {list(shape)}")
            if name == "k_mult" and not bool((t > 0).all()):
                raise InvalidInput("k_mult must be > 0 in every channel")
            changes[name] = t.detach().to(c.device, torch.float32).clone()
        for name, val in (("k_scale", k_scale), ("v_scale", v_scale)):
            if val is not None:
                changes[name] = torch.tensor([float(val)], dtype=torch.float32, device=c.device)
        return changes

    def _set(self, layer: int, changes: dict, namespace: bool) -> None:
        """Replace layer `layer`'s transform fields (its tail follows); `namespace`: the prefix
        keys' namespace follows the transforms (only while no sequence holds a root)."""
        c = self.storage
        if changes:
            c.set_layers({layer: dataclasses.replace(c.layers[layer], **changes)})
        if namespace:
            ns = storage.transform_namespace(self.config.fingerprint, c.layers)
            for g in c.core.groups:  # empty (checked): no key was computed with the old one
                g.keys.namespace = ns

    def options(self, layer: int, options=None, has_sinks: bool = False):
        """What a fit of layer `layer` fits (`calibration.CalibrationOptions`): key centre when
        the config centres keys, key multipliers and value centre as `options` (a
        `CacheOptions`; default: the config's, else the defaults) ask, decided from the codec
        traits (`pagedkv.options`)."""
        from ..options import CacheOptions, centres_values, scales_keys
        from .calibration import CalibrationOptions

        c = self.storage
        opts = options or self.config.options or CacheOptions()
        fmt = self.config.layers[c.index(layer)].format
        return CalibrationOptions(key_centring=self.config.key_centring,
                                  key_scaling=scales_keys(fmt, opts.key_scaling),
                                  value_centring=centres_values(fmt, opts.value_centring, has_sinks))

    def _fit(self, layer, keys, values, queries, options, has_sinks):
        """(Calibration, validated layer fields) of a layer fitted to sample K/V/Q."""
        from . import calibration

        pl = self.storage.kv(layer)
        cal = calibration.calibrate(keys, values, queries, pl.k_codec.name, pl.v_codec.name,
                                    self.options(layer, options, has_sinks), self.storage.device)
        scale = {name: float(getattr(cal, name)) for name in ("k_scale", "v_scale") if getattr(cal, name) is not None}
        return cal, self.validated(layer, scale.get("k_scale"), scale.get("v_scale"),
                                   cal.k_centre, cal.k_mult, cal.v_centre)

    def calibrate(self, layer: int, keys: torch.Tensor, values: torch.Tensor,
                  queries: Optional[torch.Tensor] = None, *, options=None, has_sinks: bool = False):
        """Fit and set a layer's transform (`PagedCache.calibrate_layer`) from sample K/V (float
        [B, H, T, D]) and queries ([B, Hq, T, D] or None), as the transformers drop-in fits its
        first chunk (`calibration.calibrate`, with `options`). Only while the cache holds no data
        (`configure`). Returns the Calibration."""
        self.storage.kv(layer)
        self.check_empty("calibrate_layer")
        cal, changes = self._fit(layer, keys, values, queries, options, has_sinks)
        self._set(layer, changes, namespace=True)
        return cal

    def fit(self, layer: int, keys: torch.Tensor, values: torch.Tensor,
            queries: Optional[torch.Tensor] = None, *, options=None, has_sinks: bool = False):
        """`calibrate` for a front door that fits each layer on its own first chunk while earlier
        layers already store that chunk (`PagedCache.fit_layer`, `PagedCache(fit_first_chunk=
        True)`, the transformers drop-in): allowed while this layer is not fitted and has stored
        nothing since the cache was built or `reset`. The prefix keys' namespace stays (the
        sequences hold their roots; a shared prefix store's keys cover the transform through the
        record layout). Raises before any change. Returns the Calibration."""
        self.storage.kv(layer)
        if layer in self.fitted or layer in self.written:
            raise ConfigError(f"layer {layer} already stores data under its transform; "
                              "fit_layer fits a layer before its first store (reset_transforms() first)")
        cal, changes = self._fit(layer, keys, values, queries, options, has_sinks)
        self._set(layer, changes, namespace=False)
        self.fitted = self.fitted | {layer}
        return cal

    def reset(self, layers=None) -> None:
        """Layers back to the transform they were built with (no multipliers or value centre, a
        zero key centre with key centring, unit fp8 scales), to be fitted again. layers=None:
        every layer, only while the cache holds no data (the namespace back to the
        fingerprint); else those layers, each only while it has stored nothing."""
        c = self.storage
        if layers is None:
            self.check_empty("reset_transforms")
            todo = list(range(len(c.layers)))
        else:
            todo = [c.index(i) for i in layers]
            stored = [i for i in todo if i in self.written]
            if stored:
                raise ConfigError(f"layers {stored} store data under their transform; "
                                  "reset_transforms() needs an empty cache for them")
        one = torch.ones(1, dtype=torch.float32, device=c.device)
        new = {}
        for i in todo:
            pl = c.layers[i]
            if isinstance(pl, PagedLayer):
                kc = None if pl.k_centre is None else torch.zeros_like(pl.k_centre)
                new[i] = dataclasses.replace(pl, k_centre=kc, k_mult=None, v_centre=None,
                                             k_scale=one.clone(), v_scale=one.clone())
            else:
                new[i] = dataclasses.replace(pl, latent_scale=one.clone(), rope_scale=one.clone())
        c.set_layers(new)
        if layers is None:
            for g in c.core.groups:
                g.keys.namespace = self.config.fingerprint
        self.fitted = self.fitted - frozenset(todo)
        self.written = self.written - frozenset(todo)

    # ---- a prefix store's transform record (`transform_record.SharedTransform`) --------------
    def shared(self) -> Optional[list]:
        """What this cache publishes as the store's transform record once every layer's is fixed
        (latent layers: their fp8 scales; a `fit_first_chunk` cache: the K/V transforms), else
        None (nothing yet, or a cache that fits nothing itself)."""
        c = self.storage
        if len(self.fitted) < len(c.layers) or not (self.config.latent is not None or self.fit_first_chunk):
            return None
        if self.config.latent is not None:
            return [latent_transform(pl) for pl in c.layers]
        return [{name: getattr(pl, name) for name in FIELDS} for pl in c.layers]

    def adoptable_shapes(self) -> Optional[list]:
        """The record's shapes when this cache would adopt a stored transform now (it fits its
        own and has fixed none; a latent cache also holds no block), else None."""
        c = self.storage
        if self.fitted:
            return None
        if self.config.latent is not None:
            if any(g.pool.num_used or g.pool.num_cached for g in c.core.groups):
                return None
            return [dict(LATENT_TRANSFORM_SHAPES) for _ in c.layers]
        if not self.fit_first_chunk:
            return None
        return [{"k_centre": hd, "k_mult": hd, "v_centre": hd, "k_scale": (1,), "v_scale": (1,)}
                for hd in ((pl.num_kv_heads, pl.head_dim) for pl in c.layers)]

    def adopt(self, transforms: Sequence[dict]) -> None:
        """Fix every layer's transform to a stored one (a prefix store's, written by the cache
        that fitted it) instead of fitting it: only while `adoptable_shapes()` is not None."""
        c = self.storage
        assert self.adoptable_shapes() is not None and len(transforms) == len(c.layers)
        new = {}
        for i, (pl, t) in enumerate(zip(c.layers, transforms)):
            if not isinstance(pl, PagedLayer):
                new[i] = with_latent_transform(pl, t)
                continue
            on = {k: (None if v is None else v.to(c.device, torch.float32)) for k, v in t.items()}
            new[i] = dataclasses.replace(
                pl, k_centre=on["k_centre"], k_mult=on["k_mult"], v_centre=on["v_centre"],
                k_scale=pl.k_scale if on["k_scale"] is None else on["k_scale"],
                v_scale=pl.v_scale if on["v_scale"] is None else on["v_scale"])
        c.set_layers(new)
        self.fitted = frozenset(range(len(c.layers)))
