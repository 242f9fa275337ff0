"""The sandbox's seccomp filter, compiled to BPF by libseccomp (Debian's `libseccomp2`, present
wherever systemd is) through ctypes, and handed to bubblewrap (`bwrap --seccomp FD`), which loads
it for the harness and everything it starts.

Denied with EPERM: sockets (a network namespace already has no route out; this also closes
AF_UNIX and netlink), ptrace and process_vm_* (reading another process's memory), mount,
unshare / setns and namespace-creating clone flags, bpf, perf_event_open, io_uring, keyctl,
userfaultfd, module and kexec loading, reboot, swap, chroot / pivot_root and
open_by_handle_at; and what no solution needs but costs the host memory no limit counts or
outlives the test: SysV IPC (shared memory segments survive their process; the IPC namespace
lives as long as the sandbox), POSIX message queues, extended attributes (kernel memory a
tmpfs does not report as used), sync / syncfs (the host's disks flushed on a program's say). clone3 answers ENOSYS (its flags sit in memory a filter cannot read), which
makes glibc fall back to clone, whose flags it can. Syscall numbers come from libseccomp for the
running architecture (the names below are the kernel's)."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os

DENIED = (
    "socket", "socketpair", "connect", "bind", "listen", "accept", "accept4",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "mount", "umount2", "fsopen", "fsmount", "fsconfig", "move_mount", "open_tree", "mount_setattr",
    "unshare", "setns", "chroot", "pivot_root",
    "bpf", "perf_event_open", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key", "userfaultfd",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "reboot", "swapon", "swapoff", "acct", "open_by_handle_at", "name_to_handle_at",
    "shmget", "shmat", "shmdt", "shmctl", "semget", "semop", "semtimedop", "semctl",
    "msgget", "msgsnd", "msgrcv", "msgctl", "ipc",
    "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
    "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    "setxattrat", "removexattrat",
    "sync", "syncfs",
)
# clone's flags (its first argument on x86_64 and aarch64) that make new namespaces
CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000,
                         0x00000080)  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME

# libseccomp's constants (seccomp.h, 2.5)
_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000
_CMP_MASKED_EQ = 7


class _ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


class SeccompUnavailable(RuntimeError):
    pass


@functools.lru_cache(maxsize=1)
def filter_bpf() -> bytes:
    """The compiled filter (a `struct sock_filter` array), built once per process. Raises
    SeccompUnavailable naming what is missing."""
    name = ctypes.util.find_library("seccomp")
    if name is None:
        raise SeccompUnavailable("libseccomp is not installed (Debian/Ubuntu: apt-get install libseccomp2)")
    lib = ctypes.CDLL(name, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_ALLOW)
    if not ctx:
        raise SeccompUnavailable("seccomp_init failed")
    try:
        def deny(syscall: str, code: int, *args: _ArgCmp) -> None:
            number = lib.seccomp_syscall_resolve_name(syscall.encode())
            if number < 0:  # a syscall this architecture does not have (e.g. `accept` on aarch64)
                return
            array = (_ArgCmp * len(args))(*args) if args else None
            rc = lib.seccomp_rule_add_array(ctypes.c_void_p(ctx), _ERRNO | code, number, len(args), array)
            if rc < 0:
                raise SeccompUnavailable(f"seccomp_rule_add({syscall}) failed: {os.strerror(-rc)}")

        for syscall in DENIED:
            deny(syscall, errno.EPERM)
        deny("clone3", errno.ENOSYS)
        for flag in CLONE_NAMESPACE_FLAGS:
            deny("clone", errno.EPERM, _ArgCmp(0, _CMP_MASKED_EQ, flag, flag))
        read_end, write_end = os.pipe()
        try:
            rc = lib.seccomp_export_bpf(ctypes.c_void_p(ctx), write_end)
            os.close(write_end)
            write_end = -1
            if rc < 0:
                raise SeccompUnavailable(f"seccomp_export_bpf failed: {os.strerror(-rc)}")
            chunks = []
            while chunk := os.read(read_end, 65536):
                chunks.append(chunk)
        finally:
            os.close(read_end)
            if write_end >= 0:
                os.close(write_end)
        return b"".join(chunks)
    finally:
        lib.seccomp_release(ctypes.c_void_p(ctx))
