"""A real JupyterLab server on localhost, started as `course lab` starts it: it lists the course and runs code in
a kernel through its REST API, and the kernel's connection is encrypted (no "running over TCP without encryption")."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import requests

from course_lib.tools import cli

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_up(proc: subprocess.Popen, base: str, headers: dict, log: Path, seconds: float) -> dict:
    """Poll the server's /api/status until it answers; fail with its log if it exits or takes over `seconds`."""
    deadline = time.time() + seconds
    while True:
        try:
            status = requests.get(f"{base}/api/status", headers=headers, timeout=2)
            if status.ok:
                return status.json()
        except requests.ConnectionError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            pytest.fail(f"jupyter lab did not answer at {base}:\n" + log.read_text()[-2000:])
        time.sleep(0.3)


@pytest.fixture()
def lab(tmp_path):
    port, token = _free_port(), uuid.uuid4().hex
    cmd = cli.lab_argv(ROOT, ["--no-browser", f"--port={port}", "--ip=127.0.0.1", f"--IdentityProvider.token={token}"])
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        assert "--allow-root" in cmd  # else Jupyter would refuse to start here
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "lab.log", "w"), env=env,
                            start_new_session=True)
    base, headers = f"http://127.0.0.1:{port}", {"Authorization": f"token {token}"}
    try:
        _wait_until_up(proc, base, headers, tmp_path / "lab.log", seconds=90)
        yield base, headers, port, token, tmp_path / "lab.log"
    finally:
        try:
            requests.post(f"{base}/api/shutdown", headers=headers, timeout=5)
            proc.wait(timeout=20)
        except Exception:
            proc.kill()
            proc.wait(timeout=10)


async def _execute(port: int, token: str, kernel_id: str, code: str) -> str:
    from tornado.websocket import websocket_connect

    ws = await websocket_connect(f"ws://127.0.0.1:{port}/api/kernels/{kernel_id}/channels?token={token}")
    msg_id = uuid.uuid4().hex
    ws.write_message(json.dumps({
        "header": {"msg_id": msg_id, "username": "test", "session": uuid.uuid4().hex, "msg_type": "execute_request",
                   "version": "5.3"},
        "parent_header": {}, "metadata": {}, "channel": "shell",
        "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                    "allow_stdin": False},
    }))
    out = []
    while True:
        raw = await asyncio.wait_for(ws.read_message(), timeout=60)
        msg = json.loads(raw)
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        if msg["msg_type"] == "error":
            out.append("ERROR " + msg["content"]["ename"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            ws.close()
            return "".join(out)


def test_lab_lists_the_course_and_runs_a_kernel(lab):
    base, headers, port, token, log = lab
    listing = requests.get(f"{base}/api/contents/notebooks", headers=headers, timeout=10).json()
    names = {item["name"] for item in listing["content"]}
    assert "00_start_here.ipynb" in names and "01_memory_anatomy.ipynb" in names
    kernel = requests.post(f"{base}/api/kernels", headers=headers, json={"name": "python3"}, timeout=30).json()
    try:
        out = asyncio.run(_execute(port, token, kernel["id"],
                                   "from course_lib import env\nprint('profile', env.check_profile('smoke'), 6 * 7)"))
        assert "profile smoke 42" in out
        assert "CurveZMQ" not in log.read_text() and "without encryption" not in log.read_text()
    finally:
        requests.delete(f"{base}/api/kernels/{kernel['id']}", headers=headers, timeout=10)


def test_course_lab_passes_port_and_options_to_jupyter(tmp_path):
    """`course lab --port P --no-browser` (options first, as the README writes them) starts JupyterLab on port P."""
    port, token = _free_port(), uuid.uuid4().hex
    cmd = [sys.executable, "-m", "course_lib.tools.cli", "lab", "--port", str(port), "--no-browser",
           "--ip", "127.0.0.1", f"--IdentityProvider.token={token}"]
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"))
    log = tmp_path / "lab.log"
    with open(log, "w") as out:
        # a session of its own, so that the whole tree (Jupyter replaces `course` in this process) can be ended
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        # it starts in a few seconds; a busy machine gets a minute, never longer
        status = _wait_until_up(proc, f"http://127.0.0.1:{port}", {"Authorization": f"token {token}"}, log, 60)
        assert "started" in status
    finally:
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
