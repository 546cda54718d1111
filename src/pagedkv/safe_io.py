"""Reading small files and JSON that a careless or hostile user may have put there (settings,
plans, statistics): regular files only, opened non-blocking (a FIFO never hangs the reader), at
most a size cap read (a symlink to /dev/zero or a 4 GiB file costs nothing), and JSON whose
depth or integers are too large for Python's parser reported as a ConfigError like any other
bad input (a RecursionError or ValueError otherwise)."""

from __future__ import annotations

import json
import os
import stat
from typing import Any, Callable, Optional

from .errors import ConfigError


def read_regular_file(path: str, limit: int, what: str, *, follow: bool = True,
                      check: Optional[Callable[[os.stat_result], Optional[str]]] = None) -> bytes:
    """The bytes of the regular file at `path`, at most `limit` of them; ConfigError naming
    `what` and the path if it cannot be opened, is not a regular file (a FIFO, a device, a
    directory; with follow=False also a symbolic link), is larger than `limit`, or `check(st)`
    (the open file's status) says why not."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ConfigError(f"{what} {path!r} cannot be opened ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        problem = None if stat.S_ISREG(st.st_mode) else "is not a regular file"
        if problem is None and check is not None:
            problem = check(st)
        if problem is None and st.st_size > limit:
            problem = f"is {st.st_size} bytes, more than the {limit} accepted"
        if problem is not None:
            raise ConfigError(f"{what} {path!r} {problem}")
        parts, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            parts.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise ConfigError(f"{what} {path!r} cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    data = b"".join(parts)
    if len(data) > limit:  # grew while being read
        raise ConfigError(f"{what} {path!r} is more than the {limit} bytes accepted")
    return data


def loads_json(text, what: str) -> Any:
    """json.loads, with every way the text can be refused (syntax, nesting too deep for the
    parser, an integer of more than 4,300 digits, bytes that are not UTF-8) a ConfigError naming
    `what`."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ConfigError(f"{what} cannot be read as JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, the 4300-digit limit
        raise ConfigError(f"{what} cannot be read as JSON ({str(exc)[:200]})") from None
