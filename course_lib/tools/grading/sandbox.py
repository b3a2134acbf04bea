"""Start a learner's kernel inside its sandbox (run by the grader as a script, before any learner code).

``python -I -B sandbox.py CONFIG.json [ARGS]`` reads its configuration (written by
``course_lib.tools.grading.isolation``), then:

1. when it runs in new mount, PID and network namespaces (``unshare``, as the
   grader arranges when it can): shows of the course only what a learner's
   copy holds (``course_lib``, ``data``, ``exercises``: each folder of
   ``views`` is replaced by an empty one holding only those, read-only), hides
   the instructor's folders (the class's submissions, the grades, git's
   folders) under empty mounts, makes every mount read-only, then mounts the
   work folder as a size-capped tmpfs and gives ``/tmp``, ``/var/tmp`` and
   ``/dev/shm`` folders inside it (the only writable places), and brings up
   the namespace's own loopback (the only network there is);
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
import re
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024, "nodiratime": 2048,
               "relatime": 1 << 21, "strictatime": 1 << 24}  # the flags a remount must keep (a user namespace locks them)
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 1  # 442 on every architecture
TEMP_SUBDIRS = (("/tmp", "tmp"), ("/var/tmp", ".var-tmp"), ("/dev/shm", ".shm"))  # -> folders of the work tmpfs
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 24, 47, 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522
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
        _mount("/dev/null", path, None, MS_BIND | MS_RDONLY | MS_REMOUNT)


def _expose(ancestor: str, paths: list[str], mode: int = 0o711) -> None:
    """Replace ``ancestor`` by an empty folder that holds only ``paths`` (folders under it), read-only: a folder
    the kernel's user may not enter (``/root`` holding this Python), or the course (only the learner's part)."""
    keep = [(p, os.open(p, os.O_RDONLY | os.O_DIRECTORY)) for p in paths if os.path.isdir(p)]
    _mount("none", ancestor, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode:o},size=4k")
    old = os.umask(0o022 if mode & 0o004 else 0o066)
    for path, fd in keep:
        os.makedirs(path, mode=mode, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND)
        _mount("none", path, None, MS_BIND | MS_RDONLY | MS_REMOUNT)
        os.close(fd)
    os.umask(old)


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def _read_only() -> None:
    """Every mount of this namespace read-only (``mount_setattr``, Linux 5.12; else one remount per mount)."""
    attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    if _libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)) == 0:
        return
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        target = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY | sum(MOUNT_FLAGS.get(o, 0) for o in fields[5].split(","))
        if _libc.mount(None, target.encode(), None, flags, None) != 0 and os.path.exists(target):
            _fail(f"cannot make {target} read-only: {os.strerror(ctypes.get_errno())}")


def _work(workdir: str, size: int, uid: int | None, notebook: tuple[str, bytes]) -> int:
    """The work folder as a tmpfs of ``size`` bytes (its only writable place), holding the notebook's copy, the
    results folder and the temporary folders (``/tmp`` and friends are bound to them); an open descriptor of it."""
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    _mount("none", workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},nr_inodes=20000,mode=0700{owner}")
    keep = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
    with open(os.path.join(workdir, notebook[0]), "wb") as f:
        f.write(notebook[1])
    made = [os.path.join(workdir, notebook[0])]
    for sub in ("results", *(s for _, s in TEMP_SUBDIRS)):
        os.mkdir(os.path.join(workdir, sub), 0o700)
        made.append(os.path.join(workdir, sub))
    for path in made:
        if uid is not None:
            os.chown(path, uid, uid)
    return keep


def _own_temp(workdir: str, keep: int) -> None:
    """``/tmp``, ``/var/tmp`` and ``/dev/shm`` bound to folders of the work tmpfs (one cap for all); the work
    folder, which may live under one of them, is mounted back where it was."""
    for target, sub in TEMP_SUBDIRS:
        if os.path.isdir(target):
            _mount(f"/proc/self/fd/{keep}/{sub}", target, None, MS_BIND)
    if not os.path.isdir(workdir):
        os.makedirs(workdir, mode=0o711)
        _mount(f"/proc/self/fd/{keep}", workdir, None, MS_BIND)


def _loopback() -> None:
    """Bring up ``lo`` of the namespace's own network: the kernel can talk to itself, to nothing else."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sh22x", fcntl.ioctl(s, 0x8913, struct.pack("16sh22x", b"lo", 0)))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sh22x", b"lo", flags | 1))                              # IFF_UP


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
        with open(os.path.join(workdir, cfg["notebook"]), "rb") as f:
            notebook = (cfg["notebook"], f.read())
        for ancestor, paths in cfg.get("expose", {}).items():
            _expose(ancestor, paths)
        for folder, paths in sorted(cfg.get("views", {}).items(), key=lambda kv: kv[0].count(os.sep)):
            if os.path.isdir(folder):
                _expose(folder, paths, 0o755)
        for path in cfg["hide"]:
            _hide(path)
        _read_only()
        keep = _work(workdir, cfg["disk"], uid, notebook)
        if cfg.get("own_temp", True):
            _own_temp(workdir, keep)
        os.close(keep)
        if cfg.get("loopback"):
            _loopback()
        os.chdir(workdir)  # the grader reaches the kernel's folder, and its sockets, as /proc/<this pid>/cwd
    conn = os.path.join(workdir, ".kernel.json")
    fd = os.open(conn, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.write(fd, connection)
    os.close(fd)
    if uid is not None:
        os.chown(conn, uid, gid)
    argv = [cfg["python"], "-I", "-B", "-c", BOOT, "\0".join(cfg["sys_path"]), conn, *kernel_args]

    def become_kernel() -> None:
        try:
            import resource
        except ImportError:  # not POSIX (Windows): no rlimits there; only `course check` runs on such a machine
            resource = None
        for name, value in (cfg.get("rlimits", {}) if resource else {}).items():
            which = getattr(resource, f"RLIMIT_{name}")
            hard = resource.getrlimit(which)[1]  # never above the hard limit set before us: that would fail
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(which, (value, value))
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
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(2, 1)  # the launcher's log, opened by the grader: its size is capped by RLIMIT_FSIZE
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
