"""Command construction per backend, config validation, limits and image functions (no runtime needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from raas.errors import RaasError
from raas.sandbox import backend_class, config_from_dict
from raas.sandbox.backends.apptainer import ApptainerSandbox
from raas.sandbox.backends.bwrap import BwrapSandbox, bwrap_version
from raas.sandbox.backends.docker import DockerSandbox, PodmanSandbox
from raas.sandbox.backends.local import LocalSandbox
from raas.sandbox.base import BOOT_CODE
from raas.sandbox.config import (
    ApptainerSandboxConfig,
    BwrapSandboxConfig,
    DockerSandboxConfig,
    LocalSandboxConfig,
    make_config,
    with_overrides,
)
from raas.sandbox.images import (
    ImageSpec,
    conversion_command,
    is_convertible_source,
    source_key,
    system_debian_mirror,
)
from raas.sandbox.limits import rlimit_args
from tests.conftest import unavailable

pytestmark = pytest.mark.unit


def make(cls: type, tmp_path: Path, **cfg: object):  # type: ignore[no-untyped-def]
    config = make_config(**cfg)  # type: ignore[arg-type]
    return cls(
        config,
        sandbox_id="sb-0123456789ab",
        owner="t",
        scratch=tmp_path / "sb",
        bundle_dir=tmp_path / "bundle",
    )


def flag_pairs(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_backend_factory_knows_every_name() -> None:
    assert backend_class("local") is LocalSandbox
    assert backend_class("bwrap") is BwrapSandbox
    assert backend_class("apptainer") is ApptainerSandbox
    assert backend_class("singularity") is ApptainerSandbox
    assert backend_class("docker") is DockerSandbox
    assert backend_class("podman") is PodmanSandbox
    with pytest.raises(RaasError) as e:
        backend_class("chroot")
    assert e.value.kind == "bad_request"


@pytest.mark.parametrize(
    "bad",
    [
        {"binds": ["relative:/x"]},
        {"binds": ["/a:/b:rx"]},
        {"workdir": "ws"},
        {"env": {"A=B": "1"}},
        {"env": {"RAAS_SANDBOX_ID": "x"}},
        {"bogus": 1},
    ],
)
def test_config_rejects_bad_input(bad: dict[str, object]) -> None:
    make_config(backend="bwrap")  # valid without the bad field
    with pytest.raises(ValidationError):
        make_config(backend="bwrap", **bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("backend", "cls"),
    [
        ("local", LocalSandboxConfig),
        ("bwrap", BwrapSandboxConfig),
        ("apptainer", ApptainerSandboxConfig),
        ("singularity", ApptainerSandboxConfig),
        ("docker", DockerSandboxConfig),
        ("podman", DockerSandboxConfig),
    ],
)
def test_each_backend_has_a_config_class_of_its_own(backend: str, cls: type) -> None:
    cfg = config_from_dict({"backend": backend})
    assert type(cfg) is cls and cfg.backend == backend
    assert type(config_from_dict(cfg.model_dump())) is cls  # round-trips through plain data
    assert backend_class(backend).config_class is cls


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"backend": "local", "image": "/img"}, "image"),  # local runs no image
        ({"backend": "local", "network": True}, "network"),  # nor a network namespace
        ({"backend": "local", "disk_mb": 10}, "disk_mb"),
        ({"backend": "docker", "disk_mb": 10}, "disk_mb"),  # the engine sizes its own layer
        ({"backend": "docker", "seed": {"/workspace": "/l"}}, "seed"),
        ({"backend": "bwrap", "fakeroot": False}, "fakeroot"),  # apptainer only
    ],
)
def test_a_setting_the_backend_would_ignore_is_an_error(data: dict[str, object], field: str) -> None:
    with pytest.raises(RaasError) as e:
        config_from_dict(data)
    assert e.value.kind == "bad_request"
    assert f"{field}: not a setting of the {data['backend']} backend" in e.value.message


def test_unknown_backend_lists_the_known_ones() -> None:
    with pytest.raises(RaasError) as e:
        config_from_dict({"backend": "chroot"})
    assert e.value.kind == "bad_request" and "'chroot'" in e.value.message and "bwrap" in e.value.message


def test_unset_fields_of_other_backends_are_accepted_as_none() -> None:
    assert type(make_config(backend="local", image=None, disk_mb=None)) is LocalSandboxConfig


def test_overrides_are_validated_like_the_config_itself() -> None:
    base = config_from_dict({"backend": "bwrap", "image": "/img"})
    assert with_overrides(base, workdir="/testbed").workdir == "/testbed"
    with pytest.raises(RaasError) as e:  # model_copy would have let a bind over /tmp through
        with_overrides(base, binds=["/etc:/tmp/x"])
    assert e.value.kind == "bad_request" and "writable area" in e.value.message
    with pytest.raises(RaasError):
        with_overrides(config_from_dict({"backend": "local"}), image="/img")


def test_a_backend_refuses_another_backends_config(tmp_path: Path) -> None:
    with pytest.raises(RaasError) as e:
        BwrapSandbox(
            make_config(backend="apptainer", image="/img"),
            sandbox_id="sb-0123456789ab",
            owner="t",
            scratch=tmp_path / "sb",
            bundle_dir=tmp_path,
        )
    assert e.value.kind == "bad_request" and "BwrapSandboxConfig" in e.value.message


def test_config_from_dict_is_typed() -> None:
    assert config_from_dict({"backend": "bwrap", "network": True}).network is True
    with pytest.raises(RaasError) as e:
        config_from_dict({"backend": "bwrap", "memory_mb": "lots"})
    assert e.value.kind == "bad_request"


def test_local_command(tmp_path: Path) -> None:
    sb = make(LocalSandbox, tmp_path, env={"FOO": "bar"}, memory_mb=512)
    spec = sb.build_launch()
    argv = spec.argv
    assert sys.executable in argv
    assert argv[argv.index("--socket") + 1] == str(sb.socket_path)
    assert "--watch-stdin" in argv
    assert spec.env["PYTHONPATH"] == str(tmp_path / "bundle")
    assert spec.env["FOO"] == "bar"
    assert spec.env["HOME"] == str(sb.home)
    assert spec.cwd == str(sb.workspace)
    assert boot_options(argv) == [
        "--rlimit",
        f"AS={512 << 20}",
    ]  # limits only: no mounts, no capabilities to drop


def boot_options(argv: list[str]) -> list[str]:
    i = argv.index(BOOT_CODE)
    return argv[i + 1 : argv.index("--", i)]


def dedicated(sb: object, uid: int = 1_610_612_800) -> None:
    from raas.sandbox.identity import SandboxIdentity

    sb.identity = SandboxIdentity(uid, uid, dedicated=True)  # type: ignore[attr-defined]


@pytest.mark.parametrize("as_root", [True, False])
def test_bwrap_command(tmp_path: Path, as_root: bool) -> None:
    sb = make(
        BwrapSandbox,
        tmp_path,
        backend="bwrap",
        image=str(tmp_path / "img"),
        binds=["/data:/data:ro", "/out:/out"],
        env={"X": "1,2"},
        max_procs=50,
        disk_mb=300,
        max_ptys=16,
        writable=["/testbed"],
    )
    if as_root:
        dedicated(sb)
    spec = sb.build_launch()
    argv = spec.argv
    assert spec.args_via_fd and spec.env == {}  # options through --args; no host variable reaches pid 1
    opts = argv[: argv.index("--")]
    assert opts[1] == "--unshare-all" and "--share-net" not in opts
    for flag in ("--unshare-user", "--disable-userns", "--die-with-parent", "--as-pid-1", "--clearenv"):
        assert flag in opts
    assert flag_pairs(opts, "--cap-add") == ["ALL"]  # for the boot step, which drops them all
    assert flag_pairs(opts, "--uid") == ["0"] and flag_pairs(opts, "--gid") == ["0"]
    pairs = list(zip(opts, opts[1:], opts[2:], strict=False))
    assert ("--ro-bind", str(tmp_path / "img"), "/") in pairs
    assert "--overlay-src" not in opts and "--tmp-overlay" not in opts
    assert ("--ro-bind", str(tmp_path / "bundle"), "/.raas/lib") in pairs
    assert ("--bind", str(sb.run_dir), "/.raas/run") in pairs
    assert flag_pairs(opts, "--remount-ro") == ["/.raas"]
    assert ("--ro-bind", "/data", "/data") in pairs and ("--bind", "/out", "/out") in pairs
    assert ("--setenv", "RAAS_SANDBOX_ID", "sb-0123456789ab") in pairs
    assert ("--setenv", "X", "1,2") in pairs
    assert not any(str(tmp_path) in a for a in argv[argv.index("--") :])  # host paths only in the options
    boot = boot_options(argv)
    assert flag_pairs(boot, "--disk-mb") == ["300"] and flag_pairs(boot, "--ptys") == ["16"]
    assert flag_pairs(boot, "--bind")[:2] == ["ws:/workspace", "w0:/testbed"]
    assert flag_pairs(boot, "--populate") == ["/workspace", "/testbed"]
    assert flag_pairs(boot, "--rlimit") == ["NPROC=50"]
    for flag in ("--mount-ns", "--readonly-rest", "--drop-caps"):
        assert flag in boot
    server = argv[argv.index("--", argv.index(BOOT_CODE)) + 1 :]
    assert server[server.index("--socket") + 1] == "/.raas/run/tool.sock"
    assert flag_pairs(server, "--max-sessions") == ["32"]


def test_bwrap_network_and_host_area(tmp_path: Path) -> None:
    sb = make(BwrapSandbox, tmp_path, backend="bwrap", image="/img", network=True, root_writes="host")
    argv = sb.build_launch().argv
    assert "--share-net" in argv
    pairs = list(zip(argv, argv[1:], argv[2:], strict=False))
    assert ("--bind", str(sb.area_dir), "/.raas/rw") in pairs
    assert "--disk-mb" not in boot_options(argv)  # a host dir is not capped


def test_bwrap_version_is_parsed() -> None:
    exe = "/usr/bin/bwrap"
    if not os.path.exists(exe):
        unavailable("bubblewrap not installed")
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout
    version = bwrap_version(exe)
    assert ".".join(map(str, version)) in out


@pytest.mark.parametrize("as_root", [True, False])
def test_apptainer_command(tmp_path: Path, as_root: bool) -> None:
    sb = make(
        ApptainerSandbox, tmp_path, backend="apptainer", image="/img", env={"A": "x,y"}, binds=["/d:/d:ro"]
    )
    if as_root:
        dedicated(sb)
        sb.unshare = "/usr/bin/unshare"
    spec = sb.build_launch()
    argv = spec.argv
    if as_root:  # apptainer runs under the sandbox's uid, as root of a user namespace of its own
        assert argv[:4] == ["/usr/bin/unshare", "--user", "--map-root-user", "--"]
        argv = argv[4:]
    assert argv[1:3] == ["-s", "exec"]
    for flag in ("--containall", "--cleanenv", "--no-init", "--no-home"):
        assert flag in argv
    assert "--writable-tmpfs" not in argv  # the image stays read-only; writes go to the capped area
    assert flag_pairs(argv, "--network") == ["none"] and "--net" in argv
    assert ("--userns" in argv) is as_root
    assert ("--fakeroot" in argv) is (not as_root)
    binds = flag_pairs(argv, "--bind")
    assert f"{sb.run_dir}:/.raas/run" in binds
    assert f"{tmp_path / 'bundle'}:/.raas/lib:ro" in binds
    assert "/d:/d:ro" in binds
    assert spec.env["APPTAINERENV_RAAS_SANDBOX_ID"] == "sb-0123456789ab"
    assert spec.env["APPTAINERENV_A"] == "x,y"
    assert spec.env["APPTAINERENV_PYTHONPATH"] == "/.raas/lib"
    assert spec.env["HOME"] == str(sb.home_dir)
    assert argv[argv.index("/img") + 1 :][:4] == ["python3", "-S", "-c", BOOT_CODE]
    assert "--drop-caps" in boot_options(argv) and "--readonly-rest" in boot_options(argv)


def test_apptainer_network_on_and_no_fakeroot(tmp_path: Path) -> None:
    sb = make(ApptainerSandbox, tmp_path, backend="apptainer", image="/img", network=True, fakeroot=False)
    argv = sb.build_launch().argv
    assert "--network" not in argv and "--fakeroot" not in argv and "--userns" in argv


@pytest.mark.parametrize("cls,cli", [(DockerSandbox, "docker"), (PodmanSandbox, "podman")])
def test_docker_command(tmp_path: Path, cls: type, cli: str) -> None:
    sb = make(
        cls,
        tmp_path,
        backend=cli,
        image="docker://python:3.12-slim",
        memory_mb=256,
        max_procs=64,
        file_size_mb=10,
    )
    argv = sb.build_launch().argv
    assert argv[:2] == [cli, "run"] and "--rm" in argv and "-i" in argv
    assert flag_pairs(argv, "--name") == ["raas-sb-0123456789ab"]
    assert flag_pairs(argv, "--network") == ["none"]
    assert flag_pairs(argv, "--cap-drop") == ["ALL"]
    assert flag_pairs(argv, "--security-opt") == ["no-new-privileges"]
    vols = flag_pairs(argv, "-v")
    assert f"{sb.run_dir}:/.raas/run" in vols and f"{tmp_path / 'bundle'}:/.raas/lib:ro" in vols
    assert flag_pairs(argv, "--memory") == ["256m"]
    assert flag_pairs(argv, "--pids-limit") == ["64"]
    assert flag_pairs(argv, "--ulimit") == [f"fsize={10 << 20}:{10 << 20}"]
    assert "RAAS_SANDBOX_ID=sb-0123456789ab" in flag_pairs(argv, "-e")
    i = argv.index("python:3.12-slim")
    assert argv[i + 1 : i + 5] == ["python3", "-S", "-c", BOOT_CODE]


def test_rlimits_are_applied_by_the_boot_step(tmp_path: Path) -> None:
    """Run the boot step for real (no container steps): it sets the limits, then serves."""
    assert rlimit_args(None, None, None) == []
    with pytest.raises(RaasError):
        rlimit_args(0, None, None)
    limits = rlimit_args(1024, 3, 100)
    (tmp_path / "raas_probe").mkdir()
    (tmp_path / "raas_probe" / "__init__.py").write_text("")
    boot = Path(__file__).resolve().parents[2] / "src" / "raas" / "toolserver" / "boot.py"
    (tmp_path / "raas_probe" / "boot.py").write_text(boot.read_text())
    (tmp_path / "raas_probe" / "server.py").write_text(
        "import resource as r\n"
        "def main(argv):\n"
        "    print(r.getrlimit(r.RLIMIT_AS)[0], r.getrlimit(r.RLIMIT_FSIZE)[0], r.getrlimit(r.RLIMIT_NPROC)[0], argv)\n"
    )
    args = [a for kv in limits for a in ("--rlimit", kv)]
    out = subprocess.run(
        [sys.executable, "-m", "raas_probe.boot", *args, "--", "x"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(1024 << 20), str(3 << 20), "100", "['x']"]
    bad = subprocess.run(
        [sys.executable, "-m", "raas_probe.boot", "--rlimit", "BOGUS=1", "--", "x"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert bad.returncode == 3 and "unknown resource limit BOGUS" in bad.stderr


def test_image_spec_key_is_stable_and_validated() -> None:
    a = ImageSpec(packages=("git", "python3"))
    b = ImageSpec(packages=("python3", "git", "git"))
    assert a.key() == b.key()
    assert a.key() != ImageSpec(packages=("python3",)).key()
    assert a.key() != ImageSpec(suite="trixie", packages=("git", "python3")).key()
    with pytest.raises(RaasError):
        ImageSpec(packages=("bad name",))
    with pytest.raises(RaasError):
        ImageSpec(suite="../etc")


def test_mirror_comes_from_apt_sources() -> None:
    mirror = system_debian_mirror()
    assert mirror.startswith(("http://", "https://", "file:"))
    assert "security" not in mirror


def test_image_sources(tmp_path: Path) -> None:
    sif = tmp_path / "x.sif"
    sif.write_bytes(b"x")
    assert is_convertible_source("docker://debian:12")
    assert is_convertible_source("oci-archive:/x.tar")
    assert is_convertible_source(str(sif))
    assert not is_convertible_source(str(tmp_path))
    k1 = source_key(str(sif))
    sif.write_bytes(b"xy")
    assert source_key(str(sif)) != k1  # a changed file is converted again
    assert source_key("docker://debian:12") == source_key("docker://debian:12")
    with pytest.raises(RaasError) as e:
        source_key("docker-archive:/nonexistent.tar")
    assert e.value.kind == "bad_request"
    cmd = conversion_command("apptainer", "docker://debian:12", tmp_path / "d", as_root=False)
    assert cmd[:5] == ["apptainer", "-s", "build", "--sandbox", "--force"] and "--fakeroot" in cmd
    assert cmd[-2:] == [str(tmp_path / "d"), "docker://debian:12"]
    assert "--fakeroot" not in conversion_command("apptainer", "docker://x", tmp_path / "d", as_root=True)
    assert "--fakeroot" in conversion_command(
        "apptainer", "docker://x", tmp_path / "d", as_root=True, root_has_subuid=True
    )


def test_root_writes_on_host(tmp_path: Path) -> None:
    app = make(ApptainerSandbox, tmp_path, backend="apptainer", image="/img", root_writes="host")
    argv = app.build_launch().argv
    assert f"{app.area_dir}:/.raas/rw" in flag_pairs(argv, "--bind")
    assert "--overlay" not in argv and "--writable-tmpfs" not in argv
    assert "--disk-mb" not in boot_options(argv)
