"""Group-shared layers (:mod:`raas.sandbox.layers`), attacked and accounted for.

The first job of a key prepares its sandbox and publishes it; later jobs start with the layer as seed. A
sample writing, deleting, chmod-ing or appending through a hard link in its copy must never reach the
layer or a sibling (running, or started later). One preparation per key; a failed one fails every waiting
job; a cancelled one hands over to the next. Every layer has an owner and goes away: when nobody holds it
and no job of its groups waits, after its TTL or age, over the size budget, at close, and after a crash.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from raas.errors import RaasError
from raas.sandbox import Sandbox, SandboxConfig, SandboxManager
from raas.sandbox import procs as sbprocs
from raas.sandbox.config import make_config
from raas.sandbox.layers import LayerPolicy, LayerStore, layer_key

pytestmark = pytest.mark.integration
ISOLATED = pytest.mark.parametrize("backend", ["bwrap", "apptainer"])
BWRAP = pytest.mark.parametrize("backend", ["bwrap"])  # the store's bookkeeping: one backend is enough

PREPARE = (
    "set -e; cd /workspace; mkdir -p pkg/sub; printf 'one\\n' > pkg/a.txt; printf 'two\\n' > pkg/sub/b.txt; "
    "printf '#!/bin/sh\\necho hi\\n' > run.sh; chmod 755 run.sh; ln -s pkg/a.txt rel-link; "
    "ln -s /etc/hostname abs-link; printf 'linked\\n' > h1; ln h1 h2; printf 'secret\\n' > private; "
    "chmod 600 private; mkdir -p /opt/extra; printf 'x\\n' > /opt/extra/e.txt"
)
LISTING = (
    "cd /workspace && find . /opt/extra -printf '%p %y %m %l\\n' | sort && cat pkg/a.txt pkg/sub/b.txt h1 h2 "
    "private /opt/extra/e.txt && readlink rel-link abs-link"
)
ATTACK = (
    "cd /workspace; printf 'EVIL\\n' > pkg/a.txt; rm -rf pkg/sub; rm run.sh; chmod 777 private; "
    "printf 'EVIL\\n' >> h1; printf 'new\\n' > planted; rm rel-link; ln -s /etc/passwd rel-link; "
    "printf 'EVIL\\n' > /opt/extra/e.txt; touch -d 2001-01-01 h2; echo done"
)


def tree_digest(root: Path) -> str:
    """Names, types, modes, owners, link targets and contents of everything under ``root``."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            st = p.lstat()
            h.update(f"{p.relative_to(root)} {st.st_mode:o} {st.st_uid} {st.st_nlink}".encode())
            if p.is_symlink():
                h.update(os.readlink(p).encode())
            elif p.is_file():
                h.update(p.read_bytes())
    return h.hexdigest()


async def sh(sb: Sandbox, command: str) -> str:
    res = await sb.tools.bash(command, timeout=60)
    assert res.exit_code == 0, res.output
    return res.output


waiting = True  # the groups' other jobs still wait: layers stay until the store closes


@pytest.fixture
async def store(sandbox_manager: SandboxManager) -> Any:
    s = LayerStore(sandbox_manager.scratch_root / "layers", pending=lambda groups, claimed: waiting)
    yield s
    await s.close()
    assert not s.dir.exists(), "the store left its directory behind"


def config_for(sandbox_config: SandboxConfig) -> SandboxConfig:
    return sandbox_config.model_copy(update={"writable": ["/opt"]})


@ISOLATED
@pytest.mark.parametrize("capture", ["tar", "host_area"])
async def test_samples_never_see_each_others_writes(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig, store: LayerStore, capture: str
) -> None:
    """Published through the tool server (a running sandbox) or copied from a stopped preparing
    sandbox's host area; either way the samples' copies are exact, private and leave the layer alone."""
    cfg = config_for(sandbox_config)
    key = layer_key("test", cfg)
    async with store.claim(key, group="g", job_id="j0") as share:
        assert share.preparing and not share.shared
        root_writes = "host" if capture == "host_area" else "tmpfs"
        prep = await sandbox_manager.start(cfg.model_copy(update={"root_writes": root_writes}), owner="j0")
        await sh(prep, PREPARE + "; (sleep 3600 &) ; echo started")
        pristine = await sh(prep, LISTING)
        await share.publish(prep, {"note": "prepared"})
        assert share.shared and share.meta == {"note": "prepared"}
        # A preparing sandbox copied from its host area is stopped first, down to its last process.
        assert prep.alive == (capture == "tar")
        assert (await prep.wait_exited() is not None) if capture == "host_area" else True
        assert capture == "tar" or not sbprocs.pids_with_env(prep.id)
    layer_files = Path(next(iter(share_seed(store, key).values())))
    before = tree_digest(layer_files.parent)

    async def sample(job: str) -> Sandbox:
        async with store.claim(key, group="g", job_id=job) as s:
            assert s.shared and s.meta == {"note": "prepared"}
            sb = await sandbox_manager.start(cfg.model_copy(update={"seed": s.seed}), owner=job)
            s.hold_while_open(sb)
            return sb

    if os.geteuid() == 0:  # as root, layer files are readable by the sandboxes' own uids
        pristine = pristine.replace("./private f 600", "./private f 644")
    a, b = await asyncio.gather(sample("a"), sample("b"))
    # Rootless, the layer is the sandbox user's: stacked under an overlay; as root (a uid per sandbox,
    # which cannot own the layer) it is copied.
    mounts = await sh(a, "grep ' /workspace ' /proc/self/mountinfo")
    assert ("overlay" in mounts) == (os.geteuid() != 0), mounts
    assert await sh(a, LISTING) == pristine  # the copy is exact: modes, links, hard links, extra dirs
    assert "done" in await sh(a, ATTACK)
    # The attacker cannot get at the layer under its copy either: no capabilities to unmount or remount.
    probe = await a.tools.bash("umount /workspace 2>&1; mount -o remount,rw /workspace 2>&1; echo rc=$?")
    assert "rc=0" not in probe.output
    c = await sample("c")
    assert await sh(b, LISTING) == pristine, "a running sibling saw the attacker's writes"
    assert await sh(c, LISTING) == pristine, "a later sample saw the attacker's writes"
    assert tree_digest(layer_files.parent) == before, "the layer on the host changed"
    # Layer files are the service user's, readable, and writable by nobody else; never hard-linked out.
    for p in layer_files.parent.rglob("*"):
        st = p.lstat()
        assert st.st_uid == os.geteuid()
        if not p.is_symlink():
            assert st.st_mode & 0o022 == 0, p
            assert os.geteuid() != 0 or st.st_mode & 0o444 == 0o444, p
    for sb in (prep, a, b, c):
        await sb.close()


def share_seed(store: LayerStore, key: str) -> dict[str, str]:
    entry = store._entries[key]
    assert entry.ready
    return entry.seed


@BWRAP
async def test_a_layer_stays_while_a_seeded_sandbox_lives(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    """Removing a seed's host dir would detach the sandbox's own copy mounted over it: the layer must stay
    until the last sandbox seeded from it closes, even when no job waits any more."""
    store = LayerStore(sandbox_manager.scratch_root / "layers")
    cfg = sandbox_config
    key = layer_key("hold", cfg)
    async with store.claim(key, group="g", job_id="p") as share:
        prep = await sandbox_manager.start(cfg, owner="p")
        await sh(prep, "echo kept > /workspace/kept")
        await share.publish(prep)
        await prep.close()
        async with store.claim(key, group="g", job_id="s") as mine:
            sample = await sandbox_manager.start(cfg.model_copy(update={"seed": mine.seed}), owner="s")
            mine.hold_while_open(sample)
    assert store.keys() == [key], "the layer went while a sandbox seeded from it was open"
    assert (
        await sh(sample, "cat /workspace/kept && echo more >> /workspace/kept && ls /workspace")
    ).split() == [
        "kept",
        "kept",
    ]
    await sample.close()
    await asyncio.sleep(0)  # the hold's watcher runs
    assert store.keys() == [] and not any(store.dir.iterdir())
    await store.close()


@BWRAP
async def test_one_preparation_others_wait(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    """Eight jobs of one key at once: one prepares (in a real sandbox), seven wait and get its layer."""
    store = LayerStore(sandbox_manager.scratch_root / "layers")  # no other job waits: removed after use
    cfg = sandbox_config
    key = layer_key("once", cfg)
    prepared: list[str] = []

    async def job(i: int) -> dict[str, str]:
        async with store.claim(key, group="g", job_id=f"j{i}") as share:
            if share.shared:
                return share.seed
            prepared.append(f"j{i}")
            sb = await sandbox_manager.start(cfg, owner=f"j{i}")
            await sh(sb, "echo prepared > marker")
            await asyncio.sleep(0.2)  # the others arrive while this one prepares
            await share.publish(sb)
            await sb.close()
            return {}

    seeds = await asyncio.gather(*(job(i) for i in range(8)))
    assert len(prepared) == 1
    assert sum(1 for s in seeds if s) == 7
    assert store.stats["prepared"] == 1 and store.stats["shared"] == 7
    marker = Path(next(s for s in seeds if s)[cfg.workdir]) / "marker"
    assert not marker.exists(), "the layer outlived the last job of its group"
    assert store.keys() == []
    await store.close()


@BWRAP
async def test_a_failed_preparation_fails_every_waiting_job(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    store = LayerStore(sandbox_manager.scratch_root / "layers")
    cfg = sandbox_config
    key = layer_key("broken", cfg)
    attempts = 0

    async def job(i: int) -> str:
        nonlocal attempts
        try:
            async with store.claim(key, group="g", job_id=f"j{i}") as share:
                assert not share.shared
                attempts += 1
                await asyncio.sleep(0.1)
                raise RaasError("the image is broken", kind="sandbox_start_failed")
        except RaasError as e:
            return f"{e.kind}: {e.message}"

    out = await asyncio.gather(*(job(i) for i in range(5)))
    assert attempts == 1, "a failed preparation was repeated by the waiting jobs"
    assert all(o.startswith("sandbox_start_failed") for o in out)
    assert sum("group shares failed" in o and "the image is broken" in o for o in out) == 4
    assert store.stats["failed"] == 1
    assert store.keys() == [], "a failure nobody waits for was kept"
    await store.close()


@BWRAP
async def test_a_cancelled_preparer_hands_over(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig, store: LayerStore
) -> None:
    cfg = sandbox_config
    key = layer_key("handover", cfg)
    started = asyncio.Event()

    async def first() -> None:
        async with store.claim(key, group="g", job_id="first") as share:
            assert share.preparing
            started.set()
            await asyncio.sleep(3600)

    async def second() -> bool:
        async with store.claim(key, group="g", job_id="second") as share:
            if share.shared:
                return False
            sb = await sandbox_manager.start(cfg, owner="second")
            await share.publish(sb)
            await sb.close()
            return True

    t1 = asyncio.create_task(first())
    await started.wait()
    t2 = asyncio.create_task(second())
    await asyncio.sleep(0.1)
    t1.cancel()
    assert await asyncio.wait_for(t2, 60), "the waiting job did not take over the preparation"
    assert store.stats["failed"] == 0


@BWRAP
async def test_lifetime_pending_ttl_budget(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    """Kept while a job of the group waits; swept after the idle TTL; evicted over the size budget."""
    waiting = {"g1"}
    store = LayerStore(
        sandbox_manager.scratch_root / "layers",
        LayerPolicy(idle_ttl_s=0.3, max_bytes=1500),
        pending=lambda groups, claimed: bool(groups & waiting),
    )
    cfg = sandbox_config
    try:

        async def build(key: str, group: str, size: int) -> Path:
            async with store.claim(key, group=group, job_id=f"{key}-0") as share:
                sb = await sandbox_manager.start(cfg, owner=key)
                await sh(sb, f"head -c {size} /dev/zero > blob")
                await share.publish(sb)
                await sb.close()
            return store.dir

        await build("k1", "g1", 1000)
        assert store.keys() == ["k1"], "a layer whose group still has waiting jobs was removed"
        waiting.clear()
        await asyncio.sleep(0.5)
        assert store.sweep() == 1 and store.keys() == []
        waiting.update({"g1", "g2"})
        await build("k1", "g1", 1000)
        await build("k2", "g2", 1000)  # over the budget: the idle k1 goes first
        assert store.keys() == ["k2"]
        assert store.total_bytes == 1000
        waiting.clear()
        assert store.stats["removed"] == 2
    finally:
        await store.close()
    assert not store.dir.exists()


def test_a_crashed_services_layers_are_reaped(tmp_path: Path) -> None:
    root = tmp_path / "layers"
    script = (
        "import asyncio, os, sys\n"
        "from pathlib import Path\n"
        "from raas.sandbox.layers import LayerStore\n"
        "s = LayerStore(Path(sys.argv[1]))\n"
        "(s.dir / 'left').mkdir()\n"
        "print(s.dir, flush=True)\n"
        "os._exit(0)\n"  # no atexit, no close: a crash
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(root)], capture_output=True, text=True, check=True, timeout=60
    )
    dead = Path(out.stdout.strip())
    assert dead.is_dir()
    store = LayerStore(root)
    assert not dead.exists(), "a dead process's layers were not reaped"
    store.close_sync()
    assert not store.dir.exists()


@BWRAP
async def test_close_removes_layers_in_use(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    store = LayerStore(sandbox_manager.scratch_root / "layers", pending=lambda g, c: True)
    cfg = sandbox_config
    async with store.claim("k", group="g", job_id="j") as share:
        sb = await sandbox_manager.start(cfg, owner="j")
        await share.publish(sb)
        await sb.close()
    assert store.keys() == ["k"]
    await store.close()
    assert not store.dir.exists()
    with pytest.raises(RaasError):
        async with store.claim("k", group="g", job_id="j2"):
            pass


# -- the seed in the sandbox config and the launch commands (no sandbox started) -----------------------


@pytest.mark.unit
def test_seed_must_name_a_populated_dir() -> None:
    make_config(
        backend="bwrap", workdir="/testbed", writable=["/r2e"], seed={"/testbed": "/l/d0", "/r2e": "/l/d1"}
    )
    with pytest.raises(ValueError, match="neither the workdir"):
        make_config(backend="bwrap", workdir="/testbed", seed={"/etc": "/l/d0"})
    with pytest.raises(ValueError, match="absolute"):
        make_config(backend="bwrap", workdir="/testbed", seed={"/testbed": "relative"})


@pytest.mark.unit
@pytest.mark.parametrize("dedicated", [False, True])
def test_seeds_are_bound_read_only_and_overlaid_only_when_owned(tmp_path: Path, dedicated: bool) -> None:
    from raas.sandbox.backends.apptainer import ApptainerSandbox
    from raas.sandbox.backends.bwrap import BwrapSandbox
    from raas.sandbox.base import BOOT_CODE
    from raas.sandbox.identity import SandboxIdentity

    for cls in (BwrapSandbox, ApptainerSandbox):
        cfg = make_config(
            backend=cls.backend_name, workdir="/testbed", image="/img", seed={"/testbed": "/layers/x/d0"}
        )
        sb = cls(cfg, sandbox_id="sb-0123456789ab", owner="t", scratch=tmp_path / "sb", bundle_dir=tmp_path)
        if dedicated:  # as root: a uid of the sandbox's own, which cannot own the layer
            sb.identity = SandboxIdentity(uid=1610612737, gid=1610612737, dedicated=True)
        argv = sb.build_launch().argv
        if cls is BwrapSandbox:
            i = argv.index("/layers/x/d0")
            assert argv[i - 1] == "--ro-bind" and argv[i + 1] == "/testbed"
        else:
            assert "/layers/x/d0:/testbed:ro" in argv
        boot = argv[argv.index(BOOT_CODE) :]  # the boot step's own arguments
        assert ("--overlay" in boot) == (not dedicated)
        assert "--populate" in boot  # the copy stays the fallback inside
    assert not backend_class_supports("local") and not backend_class_supports("docker")


def backend_class_supports(name: str) -> bool:
    from raas.sandbox.base import backend_class

    return backend_class(name).supports_seed
