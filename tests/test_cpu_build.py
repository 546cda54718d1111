"""Where the compiled CPU kernel comes from (issue 12, item 7): never a library another user could plant.

A planted library is a real shared object with the kernel's entry points and a constructor that
writes a marker file: if it is ever loaded, the marker exists (its code ran in this process).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from pagedkv.ops.cpu import build as kbuild

CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler")

PLANT = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) fclose(f);
}
int pkv_abi_version(void) { return %d; }
int pkv_store_abi(void) { return %d; }
int pkv_has_openmp(void) { return 1; }
"""


def _plant(directory, marker, tmp_path, variant="scalar"):
    """Put a library where the kernel would look for its build (both OpenMP names)."""
    src = tmp_path / "plant.c"
    src.write_text(PLANT % (marker, kbuild.ABI_VERSION, kbuild.STORE_ABI_VERSION))
    cc = kbuild.find_compiler(None)
    for openmp in (True, False):
        out = directory / kbuild.library_name(variant, cc, openmp)
        subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(out)], check=True)


def test_group_writable_explicit_dir_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    marker = tmp_path / "planted-ran"
    _plant(shared, marker, tmp_path)
    with pytest.raises(kbuild.KernelUnavailable, match="writable by group or others"):
        kbuild.build_and_load(kbuild.KernelConfig(cache_dir=str(shared), variant="scalar"))
    assert not marker.exists()


def test_unsafe_default_dir_falls_back_to_a_fresh_private_dir(tmp_path, monkeypatch):
    """Both default directories planted and world-writable: the kernel is built in a new private
    directory and the planted code never runs."""
    marker = tmp_path / "planted-ran"
    home, tmp = tmp_path / "home-cache", tmp_path / "tmp"
    for d in (home, tmp):
        d.mkdir()
        os.chmod(d, 0o777)
    uid = os.getuid() if hasattr(os, "getuid") else "u"
    predictable = tmp / f"pagedkv-kernels-{uid}"
    predictable.mkdir()
    os.chmod(predictable, 0o777)
    _plant(home, marker, tmp_path)
    _plant(predictable, marker, tmp_path)
    monkeypatch.setattr(kbuild, "default_cache_dir", lambda: home)
    monkeypatch.setattr(kbuild.tempfile, "gettempdir", lambda: str(tmp))
    k = kbuild.build_and_load(kbuild.KernelConfig(variant="scalar"))
    assert not marker.exists()
    where = os.path.dirname(k.path)
    assert where not in (str(home), str(predictable))
    assert kbuild.private_problem(type(home)(where), directory=True) is None
    assert os.stat(where).st_mode & 0o777 == 0o700
    shutil.rmtree(where)


def test_new_cache_dir_is_created_private(tmp_path):
    d = tmp_path / "a" / "kernels"
    k = kbuild.build_and_load(kbuild.KernelConfig(cache_dir=str(d), variant="scalar"))
    assert os.stat(d).st_mode & 0o777 == 0o700
    assert kbuild.private_problem(type(d)(k.path), directory=False) is None


def test_symlinked_library_is_refused(tmp_path):
    d = tmp_path / "kernels"
    d.mkdir(mode=0o700)
    os.chmod(d, 0o700)
    marker = tmp_path / "planted-ran"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _plant(elsewhere, marker, tmp_path)
    cc = kbuild.find_compiler(None)
    for openmp in (True, False):
        name = kbuild.library_name("scalar", cc, openmp)
        os.symlink(elsewhere / name, d / name)
    with pytest.raises(kbuild.KernelUnavailable, match="symbolic link"):
        kbuild.build_and_load(kbuild.KernelConfig(cache_dir=str(d), variant="scalar"))
    assert not marker.exists()


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to chown")
def test_library_owned_by_another_user_is_refused(tmp_path):
    d = tmp_path / "kernels"
    d.mkdir(mode=0o700)
    os.chmod(d, 0o700)
    marker = tmp_path / "planted-ran"
    _plant(d, marker, tmp_path)
    for f in d.iterdir():
        os.chown(f, 65534, 65534)
    with pytest.raises(kbuild.KernelUnavailable, match="owned by uid 65534"):
        kbuild.build_and_load(kbuild.KernelConfig(cache_dir=str(d), variant="scalar"))
    assert not marker.exists()


def test_kernel_builds_and_loads_where_a_compiler_exists(pytestconfig):
    """Where a C compiler exists the kernel must build and load, as the variant asked for
    (`--kernel-variant`) or the best this CPU runs: the kernel tests skip when it is unavailable
    (the library falls back to the reference ops), so without this a source that no longer compiles
    would leave the suite green with ~800 tests skipped."""
    from pagedkv.ops import cpu

    info = cpu.kernel_info()
    assert info["available"], f"the CPU kernel did not build with {CC}: {info.get('error')}"
    assert info["variant"] == (pytestconfig.getoption("--kernel-variant") or kbuild.detect_variant())
