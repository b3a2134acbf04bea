"""A real JupyterLab server on localhost, started as `course lab` starts it: it lists the course and runs code in
a kernel through its REST API, and the kernel's connection is encrypted (no "running over TCP without encryption")."""

from __future__ import annotations

import asyncio
import json
import os
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
        deadline = time.time() + 90
        while True:
            try:
                if requests.get(f"{base}/api/status", headers=headers, timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail("jupyter lab did not start:\n" + (tmp_path / "lab.log").read_text()[-2000:])
            time.sleep(0.5)
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
