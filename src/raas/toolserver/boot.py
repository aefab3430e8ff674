"""The first code that runs inside a sandbox: set up what only the sandbox itself can, then serve.

``python3 -m raas_toolserver.boot [options] -- <tool server arguments>``

A container runtime (bwrap, apptainer) hands this process the capabilities of a fresh user namespace and
nothing else. Before any user code exists, it uses them once, inside a new mount namespace of its own:

* **one size-limited tmpfs** (``--disk-mb``) holds every place the sandbox may write (``--bind NAME:DEST``:
  the working directory, ``/tmp``, ``/root``, ...), so ``df`` shows the cap and one sandbox cannot fill the
  host's disk or RAM; image directories named with ``--populate`` are copied into it first, so a working
  directory that the image ships with content (a repository) stays usable and writable; one named with
  ``--overlay`` (a read-only prepared layer the host bound there) gets an overlayfs whose upper layer is
  in the writable area instead of a copy, where the kernel allows it;
* **a private devpts instance** with at most ``--ptys`` terminals, so one sandbox cannot use up the
  host's pseudo-terminals;
* **the listening socket** is created here; then every mount but the writable area, /proc, /sys and the
  devpts instance is made read-only (``--readonly-rest``): the image, the tool server's code, the run
  directory that holds the socket, ``/dev``, whatever the runtime mounted;
* resource limits (``--rlimit NAME=VALUE``);
* then **every capability is dropped** (bounding set, ambient, effective, permitted, inheritable; securebits
  so uid 0 never regains any; no_new_privs) and verified, so code in the sandbox cannot undo the read-only
  mounts; the runtime's variables (host paths) are removed from the environment, also from the block
  ``/proc/1/environ`` shows.

Only then does the tool server start, in this same process (pid 1 of the sandbox, which code inside the
sandbox cannot kill or stop), on the socket created above. Any failure exits with status 3 and a message on
stderr: a sandbox whose limits could not be set up never starts.

Runs on the image's own python3 (>= 3.8), stdlib only.
"""

from __future__ import annotations

import _socket
import ctypes
import errno
import os
import resource
import stat
import sys

# ``python -c`` puts the working directory ('') first on sys.path, ``-m`` the directory it started in.
# Modules this process imports later (lazily, after the sandbox's code could write there) must never
# come from a directory the sandbox can write to.
try:
    _START_DIR = os.getcwd()
except OSError:  # started in a directory that no longer exists
    _START_DIR = ""
sys.path[:] = [p for p in sys.path if p not in ("", ".", _START_DIR)]

TYPE_CHECKING = False  # typing (and the re it imports) stays out of the start-up
if TYPE_CHECKING:
    from typing import Dict, List, Optional, Tuple

CLONE_NEWNS = 0x00020000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
# statvfs f_flag bits that a read-only remount must keep (locked mount flags may not be cleared).
_ST_TO_MS = (
    (os.ST_NOSUID, MS_NOSUID),
    (os.ST_NODEV, MS_NODEV),
    (os.ST_NOEXEC, MS_NOEXEC),
    (getattr(os, "ST_NOATIME", 1024), MS_NOATIME),
    (getattr(os, "ST_NODIRATIME", 2048), MS_NODIRATIME),
    (getattr(os, "ST_RELATIME", 4096), MS_RELATIME),
)
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
# SECBIT_NOROOT, SECBIT_NO_SETUID_FIXUP, SECBIT_KEEP_CAPS_LOCKED, SECBIT_NO_CAP_AMBIENT_RAISE and their locks.
SECUREBITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80
CAP_VERSION_3 = 0x20080522
CAP_KEYS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")
EXIT_SETUP_FAILED = 3
# Environment variables of container runtimes that name host paths: gone before anything else starts.
RUNTIME_ENV_PREFIXES = ("APPTAINER_", "SINGULARITY_", "APPTAINERENV_", "SINGULARITYENV_")
RUNTIME_ENV_NAMES = ("PS1", "PROMPT_COMMAND")


class SetupError(Exception):
    """A step of the sandbox set-up failed; the sandbox must not start."""


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


_libc = None


def libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        # The interpreter links libc: its symbols are in the global namespace (no ctypes.util search).
        lib = ctypes.CDLL(None, use_errno=True)
        if not hasattr(lib, "mount"):
            from ctypes.util import find_library

            lib = ctypes.CDLL(find_library("c"), use_errno=True)
        _libc = lib
    return _libc


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise SetupError("%s: %s" % (what, os.strerror(err) if err else "failed"))


def mount(source: Optional[str], target: str, fstype: Optional[str], flags: int, data: Optional[str]) -> None:
    def enc(s: Optional[str]) -> Optional[bytes]:
        return None if s is None else s.encode()

    ret = libc().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
    _check(ret, "mount %s on %s (%s)" % (source or fstype, target, data or hex(flags)))


def remount_readonly(path: str) -> None:
    """Make the mount at ``path`` read-only, keeping the flags the kernel does not let us clear."""
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY
    current = os.statvfs(path).f_flag
    for st_bit, ms_bit in _ST_TO_MS:
        if current & st_bit:
            flags |= ms_bit
    mount(None, path, None, flags, None)


# -- filesystem ------------------------------------------------------------------------------------


def new_mount_namespace() -> None:
    _check(libc().unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    mount(None, "/", None, MS_REC | MS_PRIVATE, None)


def _ensure_dir(path: str, mode: int) -> None:
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        if not os.path.isdir(path) or os.path.islink(path):
            raise SetupError("%s exists and is not a directory" % path) from None


def mount_writable_area(root: str, disk_mb: Optional[int]) -> None:
    """The size-limited tmpfs (or, with ``disk_mb`` None, the host dir already bound there) for all writes."""
    _ensure_dir(root, 0o755)
    if disk_mb is not None:
        mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=%dm,mode=0755" % disk_mb)


def populate(src: str, dest: str) -> None:
    """Copy an image directory's content into the writable area: directories, regular files and symlinks
    (modes and times kept); sockets, fifos and devices are skipped."""
    if not os.path.isdir(src) or os.path.islink(src):
        return
    try:
        for name in os.listdir(src):
            s, d = os.path.join(src, name), os.path.join(dest, name)
            st = os.lstat(s)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), d)
            elif stat.S_ISDIR(st.st_mode):
                os.mkdir(d, 0o700)
                populate(s, d)
                os.chmod(d, stat.S_IMODE(st.st_mode))
                os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns))
            elif stat.S_ISREG(st.st_mode):
                import shutil  # only images whose workdir has content need it

                shutil.copy2(s, d, follow_symlinks=False)
    except OSError as exc:
        raise SetupError("copying %s into the sandbox's writable area: %s" % (src, exc)) from None


def overlay_writable(root: str, name: str, dest: str) -> bool:
    """Stack a writable overlay on ``dest``: what ``dest`` holds now (a read-only layer) is the lower
    layer, ``root/name`` the upper one, so nothing is copied and every write goes to the writable area.
    False (nothing mounted) when the kernel refuses (no overlayfs in user namespaces, or files owned by a
    uid this namespace does not map): the caller copies instead."""
    try:
        st = os.stat(dest)
    except OSError:
        return False
    if st.st_uid != os.geteuid():  # a layer owned by another (unmapped) uid would fail every copy-up
        return False
    upper, work = os.path.join(root, name), os.path.join(root, "." + name + ".work")
    _ensure_dir(upper, stat.S_IMODE(st.st_mode))
    _ensure_dir(work, 0o700)
    base = "lowerdir=%s,upperdir=%s,workdir=%s" % (dest, upper, work)
    for options in (base + ",userxattr", base):  # user.* xattrs: overlayfs inside a user namespace
        try:
            mount("overlay", dest, "overlay", MS_NOSUID | MS_NODEV, options)
            return True
        except SetupError:
            continue
    return False


def bind_writable(root: str, name: str, dest: str, populate_from_image: bool, optional: bool = False) -> bool:
    """Bind ``root/name`` (created) over ``dest``; with ``populate_from_image`` copy what ``dest`` held.

    An ``optional`` destination the image lacks is skipped (False)."""
    if optional and not os.path.isdir(dest):
        return False
    src = os.path.join(root, name)
    _ensure_dir(src, 0o1777 if dest in ("/tmp", "/var/tmp", "/dev/shm") else 0o755)
    if dest in ("/tmp", "/var/tmp", "/dev/shm"):
        os.chmod(src, 0o1777)
    if not os.path.isdir(dest):
        try:
            os.makedirs(dest, 0o755)
        except OSError as exc:
            raise SetupError("cannot create mount point %s: %s" % (dest, exc)) from None
    if populate_from_image:
        populate(dest, src)
    mount(src, dest, None, MS_BIND, None)
    return True


def _unescape(field: str) -> str:
    """Mount points in /proc/self/mountinfo escape space, tab, newline and backslash as octal."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_points() -> List[str]:
    with open("/proc/self/mountinfo") as f:
        return [_unescape(line.split()[4]) for line in f if line.strip()]


def _under(path: str, roots: List[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def readonly_rest(writable: List[str]) -> None:
    """Every mount except ``writable`` ones, /proc, /sys and /dev/pts becomes read-only."""
    keep = ["/proc", "/sys", "/dev/pts"]
    for mnt in mount_points():
        if _under(mnt, keep) or mnt in writable:
            continue
        try:
            if os.statvfs(mnt).f_flag & os.ST_RDONLY:
                continue
        except OSError:
            continue  # shadowed by a later mount on the same point: the visible one is handled
        remount_readonly(mnt)


def mount_devpts(max_ptys: int) -> None:
    """A devpts instance of our own, capped at ``max_ptys``; /dev/ptmx must lead to it."""
    mount(
        "devpts",
        "/dev/pts",
        "devpts",
        MS_NOSUID | MS_NOEXEC,
        "newinstance,ptmxmode=0666,mode=0620,max=%d" % max_ptys,
    )
    ptmx = "/dev/ptmx"
    if os.path.islink(ptmx) and os.readlink(ptmx) in ("pts/ptmx", "/dev/pts/ptmx"):
        return
    # A device node /dev/ptmx opens the devpts instance mounted next to it since Linux 4.7; bind the
    # instance's own ptmx over it anyway so older kernels cannot hand out terminals of the shared one.
    mount("/dev/pts/ptmx", ptmx, None, MS_BIND, None)


def listen_unix(path: str) -> int:
    """Bind and listen on the tool socket now, before its directory becomes read-only; returns the fd."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise SetupError("cannot listen on %s: %s" % (path, exc)) from None
    fd = sock.detach()
    os.set_inheritable(fd, False)
    return fd


# -- limits and privileges ---------------------------------------------------------------------------


def set_rlimits(limits: List[Tuple[str, int]]) -> None:
    for name, value in limits:
        res = getattr(resource, "RLIMIT_" + name, None)
        if res is None:
            raise SetupError("unknown resource limit %s" % name)
        hard = resource.getrlimit(res)[1]
        if hard != resource.RLIM_INFINITY and value > hard:
            value = hard
        try:
            resource.setrlimit(res, (value, value))
        except (ValueError, OSError) as exc:
            raise SetupError("setrlimit %s=%d: %s" % (name, value, exc)) from None


def _last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 63


def capability_sets() -> Dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in CAP_KEYS:
                out[key] = int(value.strip(), 16)
    return out


def drop_all_capabilities() -> None:
    """Drop every capability for good and check that none is left."""
    lib = libc()
    if any(capability_sets().values()):
        # Before CAP_SETPCAP goes: uid 0 must never regain capabilities through execve.
        lib.prctl(PR_SET_SECUREBITS, SECUREBITS, 0, 0, 0)
        for cap in range(_last_cap() + 1):
            ret = lib.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
            if ret != 0 and ctypes.get_errno() not in (errno.EINVAL,):
                _check(ret, "dropping capability %d from the bounding set" % cap)
        lib.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        header = _CapHeader(CAP_VERSION_3, 0)
        data = (_CapData * 2)()
        _check(lib.capset(ctypes.byref(header), data), "capset")
    _check(lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    left = {k: v for k, v in capability_sets().items() if v}
    if left:
        raise SetupError("capabilities left after dropping them: %s" % left)


def _runtime_variable(entry: bytes) -> bool:
    key = entry.split(b"=", 1)[0].decode("utf-8", "replace")
    return key.startswith(RUNTIME_ENV_PREFIXES) or key in RUNTIME_ENV_NAMES


def scrub_initial_environment() -> None:
    """Blank the runtime's variables in the environment block this process was started with.

    Code in the sandbox runs as the same uid and can read ``/proc/1/environ``, which shows that block
    as it was at exec, not ``os.environ``; apptainer puts host paths there (``APPTAINER_CONTAINER``).
    The block lives in our own memory: overwrite those entries (with NULs) through /proc/self/mem."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end (fields 50 and 51)
        fd = os.open("/proc/self/mem", os.O_RDWR | os.O_CLOEXEC)
    except (OSError, ValueError, IndexError):
        return
    try:
        block = os.pread(fd, end - start, start)
        if not any(_runtime_variable(e) for e in block.split(b"\0") if e):
            return
        out = bytearray()
        for entry in block.split(b"\0"):
            out += (b"\0" * len(entry) if _runtime_variable(entry) else entry) + b"\0"
        os.pwrite(fd, bytes(out[: len(block)]), start)
    except OSError:
        pass
    finally:
        os.close(fd)


def clean_environment() -> None:
    """The runtime's variables name host paths: gone from our environment, our children's and /proc."""
    for key in list(os.environ):
        if key.startswith(RUNTIME_ENV_PREFIXES) or key in RUNTIME_ENV_NAMES:
            del os.environ[key]
    scrub_initial_environment()


# -- entry point -----------------------------------------------------------------------------------


class BootOptions:
    """What the host asked the boot step to set up (parsed from the command line)."""

    def __init__(self) -> None:
        self.mount_ns = False
        self.disk_mb = None  # type: Optional[int]
        self.area = None  # type: Optional[str]
        self.binds = []  # type: List[Tuple[str, str, bool]]
        self.populate = []  # type: List[str]
        self.overlay = []  # type: List[str]
        self.ptys = None  # type: Optional[int]
        self.listen = None  # type: Optional[str]
        self.readonly = []  # type: List[str]
        self.readonly_rest = False
        self.rlimits = []  # type: List[Tuple[str, int]]
        self.drop_caps = False


def parse(argv: List[str]) -> Tuple[BootOptions, List[str]]:
    """Options up to ``--``; the rest are the tool server's arguments."""
    if "--" not in argv:
        raise SetupError("usage: boot [options] -- <server args>")
    i = argv.index("--")
    opts = BootOptions()
    it = iter(argv[:i])
    for flag in it:
        if flag == "--mount-ns":
            opts.mount_ns = True
        elif flag == "--drop-caps":
            opts.drop_caps = True
        elif flag == "--readonly-rest":
            opts.readonly_rest = True
        else:
            try:
                value = next(it)
            except StopIteration:
                raise SetupError("%s needs a value" % flag) from None
            if flag == "--area":
                opts.area = value
            elif flag == "--disk-mb":
                opts.disk_mb = int(value)
            elif flag in ("--bind", "--bind-if"):
                name, _, dest = value.partition(":")
                if not name or "/" in name or not dest.startswith("/"):
                    raise SetupError("%s wants NAME:/ABS/DEST, got %r" % (flag, value))
                opts.binds.append((name, dest, flag == "--bind-if"))
            elif flag == "--populate":
                opts.populate.append(value)
            elif flag == "--overlay":
                opts.overlay.append(value)
            elif flag == "--ptys":
                opts.ptys = int(value)
            elif flag == "--listen":
                opts.listen = value
            elif flag == "--readonly":
                opts.readonly.append(value)
            elif flag == "--rlimit":
                name, _, num = value.partition("=")
                opts.rlimits.append((name, int(num)))
            else:
                raise SetupError("unknown option %s" % flag)
    return opts, argv[i + 1 :]


def setup(opts: BootOptions) -> Optional[int]:
    """Run every set-up step in order; returns the listening fd (if one was asked for)."""
    if opts.mount_ns:
        new_mount_namespace()
    writable = []  # type: List[str]
    if opts.area is not None:
        mount_writable_area(opts.area, opts.disk_mb)
        writable.append(opts.area)
        for name, dest, optional in opts.binds:
            if dest in opts.overlay and overlay_writable(opts.area, name, dest):
                writable.append(dest)
            elif bind_writable(opts.area, name, dest, dest in opts.populate, optional):
                writable.append(dest)
    if opts.ptys is not None:
        mount_devpts(opts.ptys)
    fd = listen_unix(opts.listen) if opts.listen else None
    for path in opts.readonly:
        remount_readonly(path)
    if opts.readonly_rest:
        readonly_rest(writable)
    set_rlimits(opts.rlimits)
    clean_environment()
    if opts.drop_caps:
        drop_all_capabilities()
    return fd


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        opts, server_args = parse(argv)
        fd = setup(opts)
    except (SetupError, OSError, ValueError) as exc:
        sys.stderr.write("raas_toolserver.boot: sandbox set-up failed: %s\n" % exc)
        sys.stderr.flush()
        os._exit(EXIT_SETUP_FAILED)
    if fd is not None:
        server_args = [*server_args, "--listen-fd", str(fd)]
    from .server import main as serve

    serve(server_args)


if __name__ == "__main__":
    main()
