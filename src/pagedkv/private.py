"""Is a path private to this user? The one check every place that trusts what it finds on disk
uses (the kernel cache's compiled libraries, the converted model folders, the disk prefix store's
generated secret, the vLLM statistics cache).

A file that another local user could have written (planted before this process made it, or
replaced afterwards) is code or data chosen by that user: it is trusted only when it and its
directory are owned by this user, are no symbolic links, and are not writable by group or others.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional


def stat_problem(st: os.stat_result, *, directory: bool) -> Optional[str]:
    """Why a file with status `st` (from lstat or fstat) may hold what someone else planted, or
    None: a symbolic link, not a directory / regular file, owned by another user, or writable
    by group or others."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if directory and not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if not directory and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):#o})"
    return None


def private_problem(path: os.PathLike, *, directory: bool) -> Optional[str]:
    """Why `path` may hold what someone else planted (None: it may not): missing, or see
    `stat_problem` (the path itself is never followed if it is a symbolic link)."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot be inspected ({exc.strerror or exc})"
    return stat_problem(st, directory=directory)


def private_dir(path: os.PathLike) -> Optional[str]:
    """Create directory `path` private (0700, parents as needed) if missing; None when it is
    private and writable, else why not."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        return f"cannot be created ({exc.strerror or exc})"
    problem = private_problem(path, directory=True)
    if problem is None and not os.access(path, os.W_OK):
        problem = "is not writable"
    return problem
