"""Start a learner's kernel inside its sandbox (run by the grader as a script, before any learner code).

``python -I -B sandbox.py CONFIG.json [ARGS]`` reads its configuration (written by
``course_lib.tools.grading.isolation``), then:

1. when it runs in new mount and PID namespaces (``unshare``, as the grader
   arranges when it can), hides the instructor's folders (solutions, the class's
   submissions, the grades) under empty read-only mounts and gives the kernel
   empty ``/tmp``, ``/var/tmp`` and ``/dev/shm`` of its own, keeping only its
   work folder;
2. forks the kernel: its own session, no privileges (a user id of its own
   when the grader is root; no capabilities and ``no_new_privs`` in namespaces),
   a clean environment, the work folder as its home and current folder,
   ``python -I`` so that neither that folder nor ``PYTHONPATH`` is on
   ``sys.path`` (the trusted ``course_lib`` is put first explicitly);
3. stays as the namespace's process 1: it reaps orphans and, when the kernel
   ends, exits, and the kernel of the operating system then kills every
   process left in the namespace, detached ones included.

Only the standard library is used: this file runs before ``sys.path`` is set up.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND = 1, 2, 4, 8, 4096
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 24, 47, 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522
TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
BOOT = ("import sys; sys.path[:0] = sys.argv[1].split('\\0'); args = ['-f', *sys.argv[2:]]; del sys.argv[1:]; "
        "from ipykernel import kernelapp; kernelapp.launch_new_instance(args)")

_libc = ctypes.CDLL(None, use_errno=True)


def _fail(message: str) -> None:
    print(f"course sandbox: {message}", file=sys.stderr, flush=True)
    os._exit(97)


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                   data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        _fail(f"cannot mount {fstype or source} on {target}: {os.strerror(err)}")


def _hide(path: str) -> None:
    """An empty, read-only mount over ``path`` (a folder) or ``/dev/null`` over it (a file)."""
    if os.path.isdir(path):
        _mount("none", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=000")
    elif os.path.exists(path):
        _mount("/dev/null", path, None, MS_BIND)
        _mount("/dev/null", path, None, MS_BIND | MS_RDONLY | 32)  # 32: MS_REMOUNT


def _own_temp(workdir: str) -> None:
    """Fresh ``/tmp`` and friends; the work folder (which may live under one of them) is mounted back."""
    keep = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
    for d in TEMP_DIRS:
        if os.path.isdir(d):
            _mount("none", d, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=1g")
    if not os.path.isdir(workdir):
        os.makedirs(workdir, mode=0o711)
        _mount(f"/proc/self/fd/{keep}", workdir, None, MS_BIND)
    os.close(keep)


def _expose(ancestor: str, paths: list[str]) -> None:
    """Replace ``ancestor`` (a folder the kernel's user may not enter, say ``/root``) by an empty one that
    holds only ``paths`` (the Python installation under it), read-only."""
    keep = [(p, os.open(p, os.O_RDONLY | os.O_DIRECTORY)) for p in paths]
    _mount("none", ancestor, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0711,size=4k")
    old = os.umask(0o066)
    for path, fd in keep:
        os.makedirs(path, mode=0o711, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND)
        _mount("none", path, None, MS_BIND | MS_RDONLY | 32)  # 32: MS_REMOUNT
        os.close(fd)
    os.umask(old)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_privileges(uid: int | None, gid: int | None) -> None:
    """Become ``uid`` (when given) with no capabilities at all, now or after ``exec``."""
    if uid is not None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)   # a non-zero uid loses every capability
    else:
        # root of a user namespace: empty the bounding set, so that exec grants nothing, then clear the rest
        for cap in range(64):
            _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
        _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        data = (_CapData * 2)()
        if _libc.capset(ctypes.byref(_CapHeader(LINUX_CAPABILITY_VERSION_3, 0)), data) != 0:
            _fail(f"cannot drop capabilities: {os.strerror(ctypes.get_errno())}")
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        _fail("cannot set no_new_privs")


def main(config_path: str, kernel_args: list[str]) -> None:
    with open(config_path) as f:
        cfg = json.load(f)
    workdir, uid, gid = cfg["workdir"], cfg.get("uid"), cfg.get("gid")
    with open(cfg["connection_file"], "rb") as f:
        connection = f.read()
    if cfg["namespaces"]:
        for ancestor, paths in cfg.get("expose", {}).items():
            _expose(ancestor, paths)
        for path in cfg["hide"]:
            _hide(path)
        if cfg.get("own_temp", True):
            _own_temp(workdir)
    conn = os.path.join(workdir, ".kernel.json")
    log = os.path.join(workdir, ".kernel.log")
    for path, data in ((conn, connection), (log, b"")):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        os.write(fd, data)
        os.close(fd)
        if uid is not None:
            os.chown(path, uid, gid)
    argv = [cfg["python"], "-I", "-B", "-c", BOOT, "\0".join(cfg["sys_path"]), conn, *kernel_args]

    def become_kernel() -> None:
        for name, value in cfg.get("rlimits", {}).items():
            import resource  # POSIX only, like the limits themselves

            resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (value, value))
        os.chdir(workdir)
        os.umask(0o077)
        if uid is not None or cfg["namespaces"]:  # without either, it runs as the instructor: nothing to drop
            _drop_privileges(uid, gid)
        os.execve(cfg["python"], argv, cfg["env"])

    if not cfg["namespaces"]:
        become_kernel()  # no namespace to hold open: this process is the kernel (the grader kills its group)
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            null = os.open(os.devnull, os.O_RDONLY)
            out = os.open(log, os.O_WRONLY | os.O_APPEND)
            os.dup2(null, 0), os.dup2(out, 1), os.dup2(out, 2)
            become_kernel()
        except BaseException as exc:  # never fall back into the parent's loop
            print(f"course sandbox: cannot start the kernel: {exc}", file=sys.stderr, flush=True)
            os._exit(97)
    # process 1 of the namespace: reap every orphan until the kernel itself ends
    while True:
        try:
            done, status = os.wait()
        except ChildProcessError:
            os._exit(0)
        if done == pid:
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        _fail("usage: python -I -B sandbox.py CONFIG.json [KERNEL ARGUMENTS]")
    main(sys.argv[1], sys.argv[2:])
