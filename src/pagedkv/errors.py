"""The exception hierarchy users see: one root, a class per kind of failure.

User errors carry a message that names the bad value and what is accepted; internal invariants
are plain asserts.
"""


class PagedKVError(Exception):
    """Root of every error pagedkv raises on purpose."""


class ConfigError(PagedKVError, ValueError):
    """A configuration value or argument is not accepted (unknown name, bad size, ...)."""


class InvalidInput(PagedKVError, ValueError):
    """A tensor argument has the wrong dtype, shape, device, or holds NaN/Inf."""


class CacheFull(PagedKVError):
    """Not enough free blocks; raised before any state changes."""


class UnknownSequence(PagedKVError, KeyError):
    """A sequence id that the cache does not hold."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if self.args else "unknown sequence"
