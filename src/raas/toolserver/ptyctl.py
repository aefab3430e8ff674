"""Terminal and process control for bash sessions, with no event loop: the shell's start-up state, tty
modes, input flushing, anonymous files, and telling whether the foreground job of a pseudo-terminal is
blocked waiting for keyboard input.

"Waiting for input" is read from ``/proc``: a process of the terminal's foreground process group that
sleeps in ``read`` on the terminal, or in ``select``/``poll``/``epoll`` on a set that includes the terminal
(REPLs, ``git add -p``, y/n prompts, password prompts on ``/dev/tty``). Busy or sleeping commands
(``sleep``, a compiler, a server waiting on a socket) are not.
"""

from __future__ import annotations

import _signal as signal  # the C module: signal.py imports enum, a sandbox's first call pays for it
import errno
import fcntl
import os
import struct
import termios

TYPE_CHECKING = False  # typing is not imported at run time: it costs a sandbox's first call
if TYPE_CHECKING:
    from typing import Any, Dict, Iterable, List, Optional, Set, Tuple


TIOCGPTPEER = 0x5441
TIOCGPTN = 0x80045430
DEV_TTY = os.makedev(5, 0)

# Syscall numbers (/proc/PID/syscall) of the calls a reader blocks in, per architecture.
_READS = {"x86_64": {0, 17, 19, 295}, "aarch64": {63, 65, 67, 69}}
_SELECTS = {"x86_64": {23, 270}, "aarch64": {72}}
_POLLS = {"x86_64": {7, 271}, "aarch64": {73}}
_EPOLLS = {"x86_64": {232, 281, 441}, "aarch64": {22, 441}}
_WCHAN_READ = {"n_tty_read", "wait_woken"}
_WCHAN_POLL = {"poll_schedule_timeout", "poll_schedule_timeout.constprop.0", "do_select", "do_sys_poll"}
_POLLIN = 0x001


def child_setup() -> None:
    """Undo what the Python parent changed but a shell must not inherit; set the tool's tty modes.

    The modes are set before bash starts so that the state bash saves (and restores after a job is
    killed) is already the tool's.
    """
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
    except (OSError, ValueError, AttributeError):
        pass
    try:
        termios.tcsetattr(0, termios.TCSANOW, neutral_modes(termios.tcgetattr(0)))
    except termios.error:
        pass


def spawn(argv: List[str], cwd: str, env: Dict[str, str], rows: int, cols: int) -> Tuple[int, int]:
    """Start ``argv`` (an absolute path) as a session leader on a new pseudo-terminal; ``(pid, master fd)``.

    The terminal is the child's stdin/stdout/stderr and controlling tty, sized ``rows`` x ``cols``, in
    the tool's modes (:func:`child_setup`); no other descriptor is inherited. An exec failure comes back
    through a close-on-exec pipe as ``OSError``. (What ``ptyprocess`` does, without importing it and the
    ``shutil``/``bz2``/``lzma`` it pulls in: that cost every sandbox's first bash call ~8 ms of CPU.)
    """
    err_r, err_w = os.pipe()  # both close-on-exec
    try:
        pid, master = os.forkpty()
    except BaseException:
        os.close(err_r)
        os.close(err_w)
        raise
    if pid == 0:  # the child: never returns into the server's code
        try:
            os.close(err_r)
            try:
                fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
            except OSError:
                pass
            os.closerange(3, err_w)
            os.closerange(err_w + 1, _max_fd())
            os.chdir(cwd)
            child_setup()
            os.execve(argv[0], argv, env)
        except BaseException as exc:
            try:
                os.write(
                    err_w, ("%d:%s" % (getattr(exc, "errno", None) or 0, exc)).encode("utf-8", "replace")
                )
            finally:
                os._exit(127)
    os.close(err_w)
    try:
        data = b""
        while True:  # EOF once exec succeeded (close-on-exec) or the child wrote why it failed
            chunk = os.read(err_r, 4096)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(err_r)
    if data:
        os.close(master)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        code, _, message = data.decode("utf-8", "replace").partition(":")
        raise OSError(int(code) if code.isdigit() else 0, message)
    return pid, master


def _max_fd() -> int:
    try:
        return min(1 << 20, os.sysconf("SC_OPEN_MAX"))
    except (OSError, ValueError):
        return 1 << 16


def memory_file(name: str, tmpdir: str) -> int:
    """An anonymous file (memfd, or an unlinked temp file where memfd is missing): nothing to delete."""
    if hasattr(os, "memfd_create"):
        try:
            return os.memfd_create(name, os.MFD_CLOEXEC)
        except OSError:
            pass
    import tempfile  # kernels before 3.17 only

    os.makedirs(tmpdir, 0o700, exist_ok=True)  # the agent may have emptied its TMPDIR, where tmpdir lives
    fd, path = tempfile.mkstemp(prefix=name, dir=tmpdir)
    os.unlink(path)
    os.set_inheritable(fd, False)
    return fd


def write_file(fd: int, data: bytes) -> None:
    """Rewrite in place: pwrite + ftruncate(len) costs microseconds, truncating to zero first does not."""
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def slave_fd(master: int) -> int:
    """A new descriptor of the terminal side of pty ``master`` (for flushing what bash has not read)."""
    try:
        return fcntl.ioctl(master, TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        pass
    buf = fcntl.ioctl(master, TIOCGPTN, b"\0\0\0\0")
    (n,) = struct.unpack("I", buf)
    return os.open("/dev/pts/%d" % n, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)


def flush_input(master: int) -> None:
    """Drop input queued for the terminal's reader (keys nobody read, a Ctrl-C byte in raw mode), and
    restart output a typed Ctrl-S (XOFF) suspended: the shell's report goes through it too."""
    try:
        fd = slave_fd(master)
    except OSError:
        return
    try:
        termios.tcflush(fd, termios.TCIFLUSH)
        termios.tcflow(fd, termios.TCOON)
    except termios.error:
        pass
    finally:
        os.close(fd)


def neutral_modes(attrs: List[Any]) -> List[Any]:
    """Terminal modes for the tool: canonical input and signals on, no echo, ``\\n`` not turned into ``\\r\\n``.

    No echo, so the output is what programs wrote; no ONLCR, so the bytes are theirs too.
    """
    attrs = list(attrs)
    attrs[3] = (attrs[3] | termios.ICANON | termios.ISIG | termios.IEXTEN) & ~(termios.ECHO | termios.ECHONL)
    attrs[1] = (attrs[1] | termios.OPOST) & ~termios.ONLCR
    attrs[0] = attrs[0] | termios.ICRNL
    return attrs


def set_modes(fd: int, attrs: List[Any]) -> bool:
    """Apply ``attrs`` if the terminal has drifted from them (``stty raw``, a killed editor); True if changed."""
    try:
        if termios.tcgetattr(fd) == attrs:
            return False
        termios.tcsetattr(fd, termios.TCSANOW, attrs)
        return True
    except termios.error:
        return False


def signals_enabled(fd: int) -> bool:
    """Whether the terminal turns Ctrl-C into SIGINT (not in ``stty raw``/``-isig`` mode)."""
    try:
        return bool(termios.tcgetattr(fd)[3] & termios.ISIG)
    except termios.error:
        return False


def foreground_group(master: int) -> Optional[int]:
    try:
        return os.tcgetpgrp(master)
    except OSError:
        return None


def _read(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return f.read(4096).decode("ascii", "replace")
    except OSError:
        return None


def _group_members(pgrp: int, sid: int) -> List[int]:
    """Live members of process group ``pgrp`` in terminal session ``sid``."""
    found = []  # type: List[int]
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        stat = _read("/proc/%s/stat" % name)
        if stat is None:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 3 and fields[0] == "S" and int(fields[2]) == pgrp and int(fields[3]) == sid:
            found.append(int(name))
    return found


def _is_terminal(pid: int, fd: int, tty: int) -> bool:
    try:
        rdev = os.stat("/proc/%d/fd/%d" % (pid, fd)).st_rdev
    except OSError:
        return False
    return rdev == tty or rdev == DEV_TTY


def _read_mem(pid: int, address: int, size: int) -> Optional[bytes]:
    if size <= 0 or size > 65536:
        return None
    try:
        fd = os.open("/proc/%d/mem" % pid, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.pread(fd, size, address)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) == size else None


def _select_fds(pid: int, nfds: int, readfds: int) -> Optional[Set[int]]:
    if readfds == 0:
        return set()
    data = _read_mem(pid, readfds, (nfds + 7) // 8)
    if data is None:
        return None
    return {i for i in range(nfds) if data[i // 8] >> (i % 8) & 1}


def _poll_fds(pid: int, address: int, count: int) -> Optional[Set[int]]:
    data = _read_mem(pid, address, 8 * count)
    if data is None:
        return None
    fds = set()
    for i in range(count):
        fd, events, _ = struct.unpack_from("ihh", data, 8 * i)
        if fd >= 0 and events & _POLLIN:
            fds.add(fd)
    return fds


def _epoll_fds(pid: int, epfd: int) -> Set[int]:
    info = _read("/proc/%d/fdinfo/%d" % (pid, epfd)) or ""
    fds = set()
    for line in info.splitlines():
        parts = line.split()
        # tfd:        0 events:       19 data: ...
        if len(parts) >= 4 and parts[0] == "tfd:" and parts[2] == "events:":
            try:
                if int(parts[3], 16) & _POLLIN:
                    fds.add(int(parts[1]))
            except ValueError:
                continue
    return fds


def _any_terminal(pid: int, fds: Iterable[int], tty: int) -> bool:
    return any(_is_terminal(pid, fd, tty) for fd in fds)


def blocked_on_terminal(pid: int, tty: int) -> bool:
    """Whether process ``pid`` sleeps waiting to read terminal ``tty`` (an ``st_rdev``)."""
    arch = os.uname().machine
    syscall = _read("/proc/%d/syscall" % pid)
    if syscall is None or arch not in _READS:
        wchan = (_read("/proc/%d/wchan" % pid) or "").strip()
        if wchan in _WCHAN_READ or wchan in _WCHAN_POLL:
            return _is_terminal(pid, 0, tty)
        return False
    parts = syscall.split()
    try:
        nr = int(parts[0])
        args = [int(a, 16) for a in parts[1:7]]
    except (ValueError, IndexError):
        return False  # "running", or not in a syscall
    if nr in _READS[arch]:
        return _is_terminal(pid, args[0], tty)
    if nr in _SELECTS[arch]:
        fds = _select_fds(pid, args[0], args[1])
        if fds is None:
            return args[0] == 1 and _is_terminal(pid, 0, tty)
        return _any_terminal(pid, fds, tty)
    if nr in _POLLS[arch]:
        fds = _poll_fds(pid, args[0], args[1])
        if fds is None:
            return args[1] == 1 and _is_terminal(pid, 0, tty)
        return _any_terminal(pid, fds, tty)
    if nr in _EPOLLS[arch]:
        return _any_terminal(pid, _epoll_fds(pid, args[0]), tty)
    return False


def waiting_for_input(master: int, session_id: int, tty: int) -> bool:
    """Whether the foreground job of the terminal (session ``session_id``) is blocked reading it."""
    pgrp = foreground_group(master)
    if pgrp is None or pgrp <= 0:
        return False
    for pid in _group_members(pgrp, session_id):
        try:
            if blocked_on_terminal(pid, tty):
                return True
        except OSError as exc:  # a process that exits while we look
            if exc.errno not in (errno.ENOENT, errno.ESRCH, errno.EACCES, errno.EPERM):
                raise
    return False
