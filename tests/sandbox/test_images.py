"""Image building and conversion: the debootstrap cache, ``raas image build``, SIF pack and unpack."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from raas.cli import app
from raas.errors import RaasError
from raas.sandbox.images import build_sif, ensure_sandbox_dir, rootfs_path, sif_squashfs_offset
from tests.conftest import TEST_IMAGE_SPEC

pytestmark = pytest.mark.integration


def test_cli_build_reuses_the_cache_and_places_a_copy(test_image: Path, tmp_path: Path) -> None:
    out = tmp_path / "rootfs"
    before = test_image.stat().st_mtime_ns
    result = CliRunner().invoke(
        app,
        [
            "image",
            "build",
            "--debian",
            "bookworm",
            "--packages",
            ",".join(TEST_IMAGE_SPEC.packages),
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert f"rootfs: {rootfs_path(TEST_IMAGE_SPEC)}" in result.output
    assert test_image.stat().st_mtime_ns == before  # reused, not rebuilt
    assert (
        (out / "usr/bin/python3").exists() and (out / ".raas/lib").is_dir() and (out / "workspace").is_dir()
    )
    again = CliRunner().invoke(app, ["image", "build", "--packages", "python3", "-o", str(out)])
    assert again.exit_code == 1 and "already exists" in again.output


def test_cli_rejects_bad_package_names() -> None:
    result = CliRunner().invoke(app, ["image", "build", "--packages", "python3,rm -rf"])
    assert result.exit_code == 1 and "bad_request" in result.output


def test_unknown_image_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(RaasError) as e:
        ensure_sandbox_dir(str(tmp_path / "missing"))
    assert e.value.kind == "bad_request"


def test_sif_offset_parsing() -> None:
    listing = (
        "ID   |GROUP   |LINK    |SIF POSITION (start-end)  |TYPE\n"
        "1    |1       |NONE    |32176-32221               |Def.FILE\n"
        "3    |1       |NONE    |36864-40960               |FS (Squashfs/*System/amd64)\n"
    )
    assert sif_squashfs_offset(listing) == 36864
    with pytest.raises(RaasError):
        sif_squashfs_offset("ID |GROUP\n")


@pytest.mark.skipif(shutil.which("apptainer") is None, reason="apptainer is not installed")
def test_apptainer_sif_pack_and_unpack_once(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "raas-test").write_text("hello\n")
    sif = build_sif(tree, tmp_path / "out" / "tree.sif")
    assert sif.is_file() and not (tmp_path / "out" / "tree.sif.part").exists()
    cache = tmp_path / "cache"
    unpacked = ensure_sandbox_dir(str(sif), cache=cache)
    assert (unpacked / "etc" / "raas-test").read_text() == "hello\n"
    for d in (".raas/lib", ".raas/run", "workspace", "tmp"):
        assert (unpacked / d).is_dir()
    stamp = unpacked.stat().st_mtime_ns
    assert ensure_sandbox_dir(str(sif), cache=cache) == unpacked and unpacked.stat().st_mtime_ns == stamp
    assert [p.name for p in cache.iterdir() if p.name.startswith(".conv-")] == []
    os.utime(sif, ns=(stamp, stamp + 10**9))  # a changed SIF is a different source
    assert ensure_sandbox_dir(str(sif), cache=cache) != unpacked


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_apptainer_source_into_unwritable_cache_is_typed(tmp_path: Path) -> None:
    sif = tmp_path / "x.sif"
    sif.write_bytes(b"not really a sif")
    cache = tmp_path / "ro-cache"
    cache.mkdir(mode=0o555)
    with pytest.raises(RaasError) as e:
        ensure_sandbox_dir(str(sif), cache=cache)
    assert e.value.kind == "sandbox_start_failed" and "RAAS_IMAGE_CACHE" in e.value.message
