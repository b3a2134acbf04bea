"""The ``course`` command.

    course run [--profile P] [--out DIR] [NOTEBOOK ...]   execute notebooks, write build/report.md
    course doctor                                         versions, device, datasets, what to fix
    course lab [JUPYTER_ARGS ...]                         JupyterLab on the course (adds --allow-root as root)
    course download cifar10                               fetch CIFAR-10 into data/
    course bench [--json]                                 speed and memory ratios (benchmarks/)
    course gpu-check [--list] [--only CHECK ...]          the GPU code paths, briefly (needs a GPU)
    course site [--build DIR]                             static HTML of the executed course
    course assign [--check]                               regenerate exercises/ from solutions/
    course grade NOTEBOOK|FOLDER [-j N] [--only S ...]    grade a learner's notebook (or a class, or regrade one)
    course check NOTEBOOK [--timeout S]                   run the visible tests, with hints
    course release DEST [--force]                         the learner's copy: no solutions, no hidden tests

`course COMMAND --help` gives each option with its unit and default.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from course_lib import env
from course_lib.tools import runner

ROOT = runner.ROOT


def _cmd_run(args: argparse.Namespace) -> int:
    profile = env.pick_profile(args.profile)
    runs = runner.run(args.notebooks or None, profile, Path(args.out), args.cell_timeout)
    failed = [r["notebook"] for r in runs if r["error"]]
    if failed:
        print(f"[course] {len(failed)} notebook(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from course_lib import data

    from course_lib import kernels

    info = env.describe()
    problems = []
    for key, value in info.items():
        print(f"{key:>16}: {value}")
    print(f"{'cpu model':>16}: {kernels.machine_key().split('|')[1]} ({kernels.machine_key().split('|')[0]})")
    for v in kernels.probe_all().values():  # measured once per machine, then read from kernels.cache_dir()
        print(f"{'kernel ' + v.kernel:>16}: {v.summary().split(': ', 1)[1]}; {kernels.KERNELS[v.kernel]}")
    try:
        print(f"{'profile':>16}: {env.pick_profile()} (set COURSE_PROFILE to smoke, cpu or gpu to change)")
    except ValueError as exc:  # an unknown COURSE_PROFILE, or gpu without CUDA
        print(f"{'profile':>16}: none usable")
        problems.append(str(exc))
    print(f"{'shapes dataset':>16}: available (generated offline)")
    if data.cifar10_available():
        print(f"{'CIFAR-10':>16}: available under {data.DATA_ROOT}")
    else:
        print(f"{'CIFAR-10':>16}: not downloaded (optional; `course download cifar10`)")
    if not info["cuda_available"]:
        print(f"{'GPU':>16}: none; the course runs on the CPU (profiles smoke and cpu)")
    if str(info.get("torchvision", "")).startswith("unavailable"):
        problems.append("torchvision does not import: reinstall with `pip install -e .`")
    for p in problems:
        print("fix:", p)
    return 1 if problems else 0


def lab_argv(root: Path = ROOT, extra: list[str] | None = None) -> list[str]:
    """The command ``course lab`` runs: JupyterLab on the course folder.

    As root (a container, a cloud VM) Jupyter refuses to start without
    ``--allow-root``, so it is added. Kernels get CurveZMQ keys, as in ``course run``.
    A leading ``--`` in ``extra`` only marks where Jupyter's arguments begin, so it is dropped.
    """
    extra = list(extra or [])
    if extra[:1] == ["--"]:
        extra = extra[1:]  # after a bare `--` Jupyter reads the rest as files to open, not as options
    argv = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={root}"]
    argv += [f"--{cls}.{key}={value}" for cls, traits in runner.KERNEL_MANAGER_CONFIG.items()
             for key, value in traits.items()]
    if hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-root" not in extra:
        argv.append("--allow-root")
    return argv + extra


def _cmd_lab(args: argparse.Namespace) -> int:
    from course_lib import kernels

    # chapter 11's torch.compile cache, keyed by this CPU and its ISA settings (kernels.inductor_cache_dir)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(kernels.inductor_cache_dir()))
    argv = lab_argv(extra=args.jupyter_args)
    if "--allow-root" in argv and "--allow-root" not in args.jupyter_args:
        print("[course] running as root: adding --allow-root (Jupyter refuses to start as root without it)")
    print("[course]", " ".join(argv[1:]), flush=True)
    os.execv(argv[0], argv)  # Jupyter takes over this process: Ctrl-C and its shutdown prompt work as usual
    return 0  # not reached


def _cmd_download(args: argparse.Namespace) -> int:
    from course_lib import data

    if args.dataset != "cifar10":
        print(f"unknown dataset {args.dataset!r}; only cifar10 is downloadable", file=sys.stderr)
        return 2
    if not data.cifar10_available(data.DATA_ROOT):
        print(f"[course] downloading CIFAR-10 (about 170 MB) from {data.CIFAR10_URL}", flush=True)
    try:
        folder = data.download_cifar10(data.DATA_ROOT)
    except ConnectionError as exc:
        print(f"course download: {exc}", file=sys.stderr)
        return 1
    print(f"CIFAR-10 is under {folder}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from course_lib.tools import bench

    table = bench.run_all(only=args.only)
    print(json.dumps(table, indent=1) if args.json else bench.format_table(table))
    return 0


def _cmd_gpu_check(args: argparse.Namespace) -> int:
    from course_lib.tools import gpu_check

    return gpu_check.run(args)


def _cmd_site(args: argparse.Namespace) -> int:
    from course_lib.tools import site

    index = site.build_site(args.build)
    print(f"[course] site: {index}")
    return 0


def _cmd_grading(args: argparse.Namespace) -> int:
    from course_lib.tools.grading import commands

    return getattr(commands, args.command)(args)


def build_parser() -> argparse.ArgumentParser:
    """The ``course`` command's parser. Every option says what it takes, in which unit, and its default
    (``tests/test_cli.py`` checks that each has a help text)."""
    parser = argparse.ArgumentParser(
        prog="course", description="Training neural networks that do not fit.",
        epilog="Run `course COMMAND --help` for a command's options. Learners: `course lab` to open the course, "
               "`course check exercises/NN_name.ipynb` to test an exercise.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("run", help="execute notebooks with papermill into build/ and write a report",
                       description="Execute notebooks top to bottom with papermill, write the executed copies, "
                                   "results.json and report.md into --out, and print each notebook's time.")
    p.add_argument("notebooks", nargs="*", metavar="NOTEBOOK",
                   help="a notebook file or a number prefix such as 04 (default: every notebook in notebooks/)")
    p.add_argument("--profile", choices=env.PROFILES,
                   help="experiment sizes (default: $COURSE_PROFILE, else gpu when PyTorch sees a GPU, else cpu)")
    p.add_argument("--out", default="build", metavar="DIR", help="output folder (default: %(default)s)")
    p.add_argument("--cell-timeout", type=int, default=None, metavar="SECONDS",
                   help="seconds one cell may run before the notebook fails (default: 900 at smoke, 3 hours at "
                        "cpu, 1 hour at gpu)")
    p.set_defaults(func=_cmd_run)
    p = sub.add_parser("doctor", help="versions, device, datasets, and what to fix",
                       description="Print the versions, the device, the profile and the datasets, and what to fix.")
    p.set_defaults(func=_cmd_doctor)
    p = sub.add_parser("lab", help="start JupyterLab on the course folder (adds --allow-root when run as root)",
                       description="Start JupyterLab on the course folder. As root, --allow-root is added.")
    p.add_argument("jupyter_args", nargs=argparse.REMAINDER, metavar="JUPYTER_ARG",
                   help="passed on to jupyter lab as they are, e.g. --port 8890 --no-browser; a leading -- "
                        "is dropped (default: none)")
    p.set_defaults(func=_cmd_lab)
    p = sub.add_parser("download", help="download a dataset into data/",
                       description="Download a dataset into data/.")
    p.add_argument("dataset", metavar="DATASET",
                   help="the dataset to fetch; only cifar10 (about 170 MB, into data/cifar-10-batches-py/)")
    p.set_defaults(func=_cmd_download)
    p = sub.add_parser("bench", help="measure the speed and memory ratios in benchmarks/",
                       description="Run the benchmarks in benchmarks/ and print their ratios beside their goals.")
    p.add_argument("--json", action="store_true", help="print the table as JSON (default: a text table)")
    p.add_argument("--only", nargs="*", metavar="MODULE",
                   help="run only these benchmark modules, e.g. ddp or bench_ddp (default: all)")
    p.set_defaults(func=_cmd_bench)
    p = sub.add_parser("gpu-check", help="run the course's GPU code paths briefly, with CUDA memory statistics "
                                         "beside the predictions (needs a GPU; --list works anywhere)",
                       description="Run each chapter's GPU code path briefly (under 10 minutes in all) and print "
                                   "one table: result, time, CUDA's peak memory beside the prediction.")
    p.add_argument("--list", action="store_true", help="list the checks and exit (no GPU needed)")
    p.add_argument("--only", nargs="*", metavar="CHECK",
                   help="run only these checks, named as --list names them (default: all)")
    p.set_defaults(func=_cmd_gpu_check)
    p = sub.add_parser("site", help="build a static HTML version of the executed course under build/site/",
                       description="Build a static HTML version of the executed course under BUILD/site/.")
    p.add_argument("--build", default="build", metavar="DIR",
                   help="the folder `course run` wrote (default: %(default)s)")
    p.set_defaults(func=_cmd_site)
    p = sub.add_parser("assign", help="regenerate exercises/ from solutions/",
                       description="Regenerate exercises/ from solutions/ (stubs with hints, no hidden tests).")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 and name the files if exercises/ is out of date")
    p.set_defaults(func=_cmd_grading)
    p = sub.add_parser("grade", help="grade a notebook, or every notebook in a folder (CSV, summary, feedback)",
                       description="Grade a learner's notebook with the instructor's tests, hidden ones included, "
                                   "in a sandboxed kernel; or every .ipynb under a folder.")
    p.add_argument("notebook", metavar="NOTEBOOK_OR_FOLDER", help="a learner's .ipynb, or a folder of them")
    p.add_argument("--timeout", type=int, default=60, metavar="SECONDS",
                   help="seconds one cell may run before its question scores zero (default: %(default)s)")
    p.add_argument("--notebook-timeout", type=float, default=None, metavar="SECONDS",
                   help="seconds for all the cells of one notebook (default: ten times --timeout, at least 120)")
    p.add_argument("-j", "--jobs", type=int, default=None, metavar="N",
                   help="with a folder: the number of notebooks graded at once (default: 1)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (default: a text table)")
    p.add_argument("--csv", metavar="PATH", help="with a folder: where to write the CSV, outside FOLDER (default: "
                                                 "FOLDER-grades/grades.csv beside it); the JSON, the summary and "
                                                 "the LMS export go beside it")
    p.add_argument("--feedback", metavar="DIR", help="with a folder: the per-student feedback folders, outside "
                                                     "FOLDER (default: feedback/ beside the CSV; 'none' for none)")
    p.add_argument("--only", nargs="+", metavar="STUDENT",
                   help="with a folder: grade again only these students (folder names) or notebooks, into the "
                        "earlier outputs; the other rows stay as they were (default: grade everyone)")
    p.add_argument("--roster", metavar="CSV",
                   help="with a folder: a CSV with columns student (folder name) and id (the LMS's), for the "
                        "lms_id column of the LMS export (default: the earlier run's when regrading, else none)")
    p.set_defaults(func=_cmd_grading)
    p = sub.add_parser("check", help="run an exercise's visible tests the way the grader does, with hints",
                       description="Run an exercise notebook in a fresh kernel against its visible tests, the way "
                                   "the grader does, and print each question's status with its hint. Exit status "
                                   "0 when every question passes.")
    p.add_argument("notebook", metavar="NOTEBOOK",
                   help="your copy of an exercise, e.g. exercises/01_memory_anatomy.ipynb (keep its file name)")
    p.add_argument("--timeout", type=int, default=60, metavar="SECONDS",
                   help="seconds one cell may run before its question counts as timed out (default: %(default)s); "
                        "the whole notebook gets ten times that, at least 120")
    p.set_defaults(func=_cmd_grading)
    p = sub.add_parser("release", help="write the learner's copy of the course: no solutions, no hidden tests",
                       description="Write the learner's copy of the course into DEST: the notebooks, the library "
                                   "and the exercises, without the solutions, the tests and the hidden tests.")
    p.add_argument("dest", metavar="DEST", help="a new (or empty) folder")
    p.add_argument("--force", action="store_true",
                   help="replace DEST if it holds an earlier release (default: refuse a folder that is not empty)")
    p.set_defaults(func=_cmd_grading)
    return parser


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    if argv[:1] == ["lab"] and argv[1:2] not in (["-h"], ["--help"]):
        # everything after `lab` is Jupyter's, options included: argparse's REMAINDER would reject an option
        # such as --port that comes first, so the lab command's arguments bypass the parser
        args = parser.parse_args(["lab"])
        args.jupyter_args = argv[1:]
        return args
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else list(argv))
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"course {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
