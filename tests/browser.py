"""A small headless-Chromium driver over the DevTools protocol (no extra packages): open a page, evaluate JavaScript, screenshot."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import requests

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
# Without these, Chromium tries to reach Google's services at start and on every page (no network here).
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1200,900"]


class Browser:
    def __init__(self) -> None:
        if CHROMIUM is None:
            raise RuntimeError("Chromium is not installed: `apt-get install chromium` (Debian) or use .ci/run")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.profile = tempfile.mkdtemp(prefix="chromium-")
        self.proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--remote-debugging-port={self.port}",
                                      f"--user-data-dir={self.profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 60
        while True:
            try:
                targets = requests.get(f"http://127.0.0.1:{self.port}/json", timeout=5).json()
                self.ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
                break
            # not listening yet, or listening but too busy starting to answer (a loaded machine): try again until
            # the deadline; a half-written answer (ValueError from .json()) likewise
            except (requests.RequestException, ValueError, StopIteration):
                if time.time() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError("Chromium did not start")
                time.sleep(0.3)
        self._id = 0

    async def _call(self, ws, method: str, **params):
        self._id += 1
        my_id = self._id
        ws.write_message(json.dumps({"id": my_id, "method": method, "params": params}))
        while True:
            msg = json.loads(await asyncio.wait_for(ws.read_message(), timeout=60))
            if msg.get("id") == my_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def visit(self, url: str, script: str, screenshot: Path | None = None):
        """Load ``url``, wait for it, return the value of ``script``; optionally save a PNG screenshot."""
        async def go():
            from tornado.websocket import websocket_connect

            ws = await websocket_connect(self.ws_url, max_message_size=256 * 2**20)
            await self._call(ws, "Page.enable")
            await self._call(ws, "Page.navigate", url=url)
            for _ in range(200):  # wait for the load to finish (images included)
                state = await self._call(ws, "Runtime.evaluate", expression="document.readyState", returnByValue=True)
                if state["result"].get("value") == "complete":
                    break
                await asyncio.sleep(0.1)
            result = await self._call(ws, "Runtime.evaluate", expression=script, returnByValue=True)
            if screenshot is not None:
                shot = await self._call(ws, "Page.captureScreenshot", format="png")
                screenshot.write_bytes(base64.b64decode(shot["data"]))
            ws.close()
            return result["result"].get("value")

        return asyncio.run(go())

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)
