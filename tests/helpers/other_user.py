"""Another local user, for the trust tests: the attacker who plants files in a shared directory.

Only root can act as another user: `as_other_user` runs a function in a forked child that drops
to uid/gid 65534 (nobody) first; `skip_reason()` says why a test that needs
it cannot run (not root, or not on a POSIX system). `shared_dir()` is a world-writable sticky
directory (like /tmp) that both users can create entries in.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Optional

OTHER_UID = 65534


def skip_reason() -> Optional[str]:
    if not hasattr(os, "setuid"):
        return "needs a POSIX system to act as a second user"
    if os.geteuid() != 0:
        return "acting as a second local user needs root (os.setuid); run the suite as root to test it"
    return None


def as_other_user(fn, *args) -> None:
    """Run `fn(*args)` in a forked child that first drops to uid/gid 65534 (its files are that
    user's, made with umask 022); raises if it fails. `fn` should only touch files (the child
    leaves with os._exit, running no cleanup of this process)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test
        code = 1
        try:
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            os.umask(0o022)
            fn(*args)
            code = 0
        except BaseException as exc:  # noqa: BLE001 - reported through the exit status
            try:
                os.write(2, f"other user: {exc!r}\n".encode())
            except OSError:
                pass
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise AssertionError(f"the other user's process failed (status {status})")


def _plant(root: str, files: dict) -> None:
    os.makedirs(root, exist_ok=True)
    for rel, data in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def plant_tree(root: str, files: dict) -> None:
    """The other user creates `root` (0755) and writes `files` (relative path -> bytes) in it."""
    as_other_user(_plant, str(root), files)


@contextlib.contextmanager
def shared_dir():
    """A fresh directory both users can create entries in (mode 1777, like /tmp)."""
    d = tempfile.mkdtemp(prefix="pagedkv-shared-", dir="/tmp")
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def tree_files(root: str, skip=(".tmp",)) -> dict:
    """relative path -> bytes of every regular file under `root` (not under `skip`)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        for name in filenames:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out
