"""The prefix chain of a block group: the one place chain keys are computed (`chain` for a
prompt, `commit` for a sequence's newly full committed blocks, which it keys in the pool), the
lookup of a prompt's hits (`match`), and what a prefix tier publishes (`newly_full`). Mixed into
`SequenceManager`; plain Python, no torch.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Sequence, Union

from ..errors import ConfigError
from .hashing import Salt, chain_hash, root_hash


class PrefixChain:
    """Prefix keys of `SequenceManager` (see the module doc)."""

    def chain(self, tokens: Sequence[int], salt: Salt = None) -> list[bytes]:
        """Keys of the full blocks a prompt could hit (always leaving one token to run)."""
        try:
            root = root_hash(self.namespace, salt)
        except TypeError as exc:
            raise ConfigError(str(exc)) from None
        bs, out, h = self.block_size, [], root
        for i in range((len(tokens) - 1) // bs if tokens else 0):
            h = chain_hash(h, tokens[i * bs:(i + 1) * bs])
            out.append(h)
        return out

    def match(self, tokens: Sequence[int], salt: Salt = None) -> int:
        """Leading full blocks of `tokens` the pool holds now (no change)."""
        if not self.prefix:
            return 0
        n = 0
        for h in self.chain(tokens, salt):
            if self.pool.lookup(h) is None:
                break
            n += 1
        return n

    def commit(self, seq_ids: Union[Hashable, Iterable[Hashable]]) -> None:
        """Mark every allocated token of the sequences as written; key newly full blocks."""
        if isinstance(seq_ids, (list, tuple, set, frozenset)) and seq_ids not in self:
            ids = list(seq_ids)
        else:
            ids = [seq_ids]
        seqs = [self._get(i) for i in ids]
        bs, pool = self.block_size, self.pool
        for s in seqs:
            s.committed = len(s.tokens)
            if not self.prefix:
                continue
            full = min(s.committed, s.first_unknown) // bs
            h = s.hashes[-1] if s.hashes else s.root
            for i in range(len(s.hashes), full):
                h = chain_hash(h, s.tokens[i * bs:(i + 1) * bs])
                s.hashes.append(h)
                if s.table[i] >= 0:
                    pool.register(s.table[i], h)

    def newly_full(self, seq_id: Hashable) -> list[tuple[int, bytes]]:
        """(pool block, chain key) of the committed, keyed blocks not handed out before (for a
        prefix tier to publish); swapped ones are skipped (published before they left)."""
        s = self._get(seq_id)
        out = [(s.table[i], s.hashes[i]) for i in range(s.published, len(s.hashes))
               if s.table[i] >= 0]
        s.published = len(s.hashes)
        return out

