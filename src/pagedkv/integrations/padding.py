"""Padded batches in the transformers cache: the mask object the "pagedkv" mask function hands to
the attention function, and the helpers that pick a chunk's valid tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

from ..errors import InvalidInput

if TYPE_CHECKING:
    from .transformers import PagedCacheLayer


class PaddingMask:
    """What the "pagedkv" mask interface hands the attention function for a 2D attention_mask
    (instead of a dense [B, 1, Tq, Tk] mask: causality and windows are applied inside the ops).

    mask: bool [B, C], C = columns seen so far including the current chunk's Tq (1 = a token,
    0 = a pad); kv_length / kv_offset: the key span transformers sized for the layer type
    (used by the dense path only).
    """

    __slots__ = ("mask", "q_length", "kv_length", "kv_offset", "all_valid", "_chunk")

    def __init__(self, mask: torch.Tensor, q_length: int, kv_length: int, kv_offset: int):
        self.mask = mask
        self.q_length = q_length
        self.kv_length = kv_length
        self.kv_offset = kv_offset
        self.all_valid = bool(mask.all())
        self._chunk = False  # not computed yet

    @property
    def columns(self) -> int:
        return self.mask.shape[1]

    def chunk(self) -> Optional[torch.Tensor]:
        """bool [B, Tq]: which of the current chunk's tokens are real; None when all are."""
        if self._chunk is False:
            c = None if self.all_valid else self.mask[:, self.columns - self.q_length:]
            self._chunk = None if c is None or bool(c.all()) else c
        return self._chunk

    def key_validity(self, tk: int) -> Optional[torch.Tensor]:
        """bool [B, tk] for keys given densely (columns kv_offset.. as transformers sized them,
        missing columns invalid as in transformers' own masks); None when all are valid."""
        if self.all_valid and self.columns >= self.kv_offset + tk:
            return None
        m = self.mask
        width = self.kv_offset + self.kv_length
        if m.shape[1] < width:
            m = torch.nn.functional.pad(m, (0, width - m.shape[1]))
        m = m[:, self.kv_offset:width]
        if m.shape[1] != tk:
            raise InvalidInput(f"attention_mask spans {m.shape[1]} keys but the attention got {tk}")
        return m


class ColumnMap:
    """Which columns of a padded batch each row stored: transformers counts columns (pads
    included, `get_seq_length`), the engine's sequences hold only the valid tokens, packed.
    `valid`: bool [rows, columns] on cpu, None while every column was valid."""

    def __init__(self):
        self.valid: Optional[torch.Tensor] = None
        self._memo: Optional[tuple] = None  # (columns, row_lengths(columns))

    def clear(self) -> None:
        self.valid, self._memo = None, None

    def row_lengths(self, columns: int, rows: int) -> list[int]:
        """Tokens each of `rows` rows stored in its first `columns` columns."""
        if self.valid is None:
            return [columns] * rows
        if self._memo is None or self._memo[0] != columns:
            self._memo = (columns, self.valid[:, :columns].sum(dim=1).tolist())
        return self._memo[1]

    def record(self, start: int, valid: Optional[torch.Tensor], rows: int, count: int) -> None:
        """Note which of the columns start..start+count each row stored (valid: bool [rows,
        count], None = all). The first layer to store a chunk records it; the others find it."""
        if self.valid is None:
            if valid is None:
                return
            self.valid = torch.ones(rows, start, dtype=torch.bool)
        width = self.valid.shape[1]
        if start + count <= width:
            return
        assert start <= width, (start, width)
        new = (torch.ones(rows, count, dtype=torch.bool) if valid is None
               else valid.detach().to("cpu", torch.bool))
        self.valid = torch.cat([self.valid[:, :start], new], dim=1)
        self._memo = None

    def check_past(self, past: Optional[torch.Tensor], rows: int, start: int) -> None:
        """InvalidInput unless `past` (bool [rows, start] on cpu: the columns before a chunk that
        its mask marks as tokens, None = all) are the columns the rows stored (as `generate`
        passes the mask of every column seen so far)."""
        stored = None if self.valid is None else self.valid[:, :start]
        if (past is not None and not bool(past.all())) or stored is not None:
            want = torch.ones(rows, start, dtype=torch.bool) if stored is None else stored
            got = torch.ones(rows, start, dtype=torch.bool) if past is None else past
            if not torch.equal(want, got):
                raise InvalidInput(
                    f"attention_mask marks {got.sum(1).tolist()} valid past tokens per row but the "
                    f"cache stored {want.sum(1).tolist()} (or at other columns): pass the mask of "
                    "every column seen so far (as generate does)")

    def select(self, sources: Sequence[int]) -> None:
        """New row i = old row sources[i]."""
        if self.valid is not None:
            self.valid = self.valid[torch.tensor(list(sources), dtype=torch.long)]
            self._memo = None

    def keep(self, columns: int) -> None:
        if self.valid is not None:
            self.valid = self.valid[:, :columns]
            self._memo = None

    def columns_at(self, row: int, n: int) -> int:
        """The columns at which row `row` has stored n tokens."""
        if self.valid is None:
            return n
        return int(torch.searchsorted(self.valid[row].long().cumsum(0), n)) + 1


def pack(x: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """The valid tokens of x [B, T, ...] row-major as [N, ...] (valid bool [B, T], None = all)."""
    return x.reshape(-1, *x.shape[2:]) if valid is None else x[valid.to(x.device)]


def unpack(rows: torch.Tensor, valid: Optional[torch.Tensor], b: int, t: int) -> torch.Tensor:
    """`pack` undone: [N, ...] -> [B, T, ...], zeros at the pads."""
    if valid is None:
        return rows.reshape(b, t, *rows.shape[1:])
    full = rows.new_zeros(b, t, *rows.shape[1:])
    full[valid.to(rows.device)] = rows
    return full


def valid_tokens(x: torch.Tensor, valid: Optional[torch.Tensor], counts: Sequence[int]) -> torch.Tensor:
    """The valid tokens of x float [B, H, T, D] for the first-chunk statistics: x itself without
    padding; [B, H, n, D] when every row has n valid tokens; else all rows' valid tokens as one
    row [1, H, N, D] (the statistics then pool the rows' tokens instead of averaging per row)."""
    if valid is None:
        return x
    b, h, t, d = x.shape
    packed = x.transpose(1, 2)[valid]  # [N, H, D], row-major
    if len(set(counts)) == 1:
        return packed.reshape(b, counts[0], h, d).transpose(1, 2)
    return packed.transpose(0, 1)[None]


def chunk_validity(mask, layer: "PagedCacheLayer", batch: int, tq: int) -> Optional[torch.Tensor]:
    """Check the attention function's mask against the paged layer; return bool [B, Tq] (which
    current tokens are real) or None (all). Raises InvalidInput on a mask that does not fit."""
    if mask is None:
        return None
    if not isinstance(mask, PaddingMask):
        raise InvalidInput(
            f"attn_implementation='pagedkv' with a PagedKVCache takes a 2D attention_mask [B, "
            f"past + new] (1 = token, 0 = pad), got a prepared {type(mask).__name__}"
            f"{' of shape ' + str(list(mask.shape)) if hasattr(mask, 'shape') else ''}"
        )
    if mask.mask.shape[0] != batch or mask.q_length != tq or mask.columns != layer.length:
        raise InvalidInput(
            f"attention_mask has shape {list(mask.mask.shape)} but the cache holds "
            f"{layer.length - tq} columns and the batch adds {tq} tokens to {batch} rows: pass "
            f"a mask [{batch}, {layer.length}] covering every column seen so far"
        )
    start = layer.length - tq
    if not (mask.all_valid and layer.cache.rows.columns.valid is None):
        layer.cache.rows.columns.check_past(mask.mask[:, :start].cpu(), batch, start)
    return mask.chunk()


def mask_columns(mask, batch: int, q_length: int, columns: int) -> Optional[torch.Tensor]:
    """Which columns of each row are tokens, from the mask an attention module received for a
    chunk of q_length queries over `columns` columns (past + new): bool [B, columns] on cpu, or
    None when every column is a token. Takes a `PaddingMask` (its 2D mask), a 2D integer / bool
    attention_mask [B, columns] (1 = token), None, or the prepared
    4D causal mask transformers builds for eager / sdpa ([B, 1 or H, q_length, columns]; bool:
    True = attend, float: 0 = attend). A 4D mask is read off its last query row (which sees every
    token column: no window applies) and must be exactly the causal mask over those columns:
    anything else (a custom mask function, a sliding window) raises InvalidInput, as does a
    mask of another shape."""
    if mask is None:
        return None
    if isinstance(mask, PaddingMask):
        cols = mask.mask
    elif isinstance(mask, torch.Tensor) and mask.dim() == 2 and not mask.is_floating_point():
        cols = mask != 0  # a 2D attention_mask as users pass it (1 = token, 0 = pad)
    elif isinstance(mask, torch.Tensor) and mask.dim() == 4:
        if mask.shape[0] != batch or mask.shape[2] != q_length or mask.shape[3] != columns:
            raise InvalidInput(
                f"attention mask has shape {list(mask.shape)}; expected [{batch}, 1, {q_length}, "
                f"{columns}] (batch rows x new tokens x columns seen so far)")
        seen = mask if mask.dtype == torch.bool else mask == 0
        cols = seen[:, 0, -1]  # [B, columns]
        pos = torch.arange(columns, device=mask.device)
        causal = pos[None, :] <= pos[columns - q_length:, None]  # [q_length, columns]
        if not bool((seen == (causal[None, None] & cols[:, None, None])).all()):
            raise InvalidInput(
                "the attention mask is not the causal mask of a padded batch (a custom mask "
                "function or a sliding window?); the pagedkv latent cache applies causality "
                "itself and takes only padding: pass a 2D attention_mask [batch, columns]")
    else:
        raise InvalidInput(f"attention_mask must be a 2D integer padding mask or transformers' prepared 4D "
                           f"mask, got {type(mask).__name__} of shape {list(getattr(mask, 'shape', []))}")
    if cols.shape != (batch, columns):
        raise InvalidInput(f"attention_mask has shape {list(cols.shape)}; expected [{batch}, "
                           f"{columns}] (batch rows x columns seen so far, the {q_length} new included)")
    cols = cols.detach().to("cpu", torch.bool)
    return None if bool(cols.all()) else cols
