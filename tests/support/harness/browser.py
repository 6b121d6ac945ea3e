"""A real headless Chromium driven over the DevTools protocol (aiohttp's websocket client; no
Playwright or Selenium needed): open a page, evaluate JavaScript in it, take a screenshot.

Debian's ``chromium`` package; :func:`why_not` says why it cannot run where it cannot.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def why_not() -> str | None:
    if chromium_path() is None:
        return "no Chromium here (apt-get install chromium)"
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        return "aiohttp is not installed (it is in the dev extra)"
    return None


class Browser:
    """One headless Chromium process (ended by PID in :meth:`close`) and one page in it."""

    def __init__(self, width: int = 1280, height: int = 900) -> None:
        self.profile = tempfile.mkdtemp(prefix="psring-chromium-")
        path = chromium_path()
        assert path is not None
        self.proc = subprocess.Popen(
            [path, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--remote-debugging-address=127.0.0.1",
             "--remote-debugging-port=0", f"--user-data-dir={self.profile}", f"--window-size={width},{height}",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        self._ids = itertools.count(1)
        self._session: Any = None
        self._ws: Any = None

    async def start(self, timeout: float = 30) -> None:
        import aiohttp

        port = None
        deadline = time.monotonic() + timeout
        port_file = os.path.join(self.profile, "DevToolsActivePort")
        while port is None:
            if os.path.exists(port_file):
                with open(port_file) as fh:
                    first = fh.readline().strip()
                if first.isdigit():
                    port = int(first)
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start: {self.proc.stderr.read() if self.proc.stderr else ''}")
            await asyncio.sleep(0.1)
        self._session = aiohttp.ClientSession()
        async with self._session.get(f"http://127.0.0.1:{port}/json/list") as resp:
            targets = await resp.json()
        page = next(t for t in targets if t.get("type") == "page")
        self._ws = await self._session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        await self.call("Page.enable")
        await self.call("Runtime.enable")

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        rid = next(self._ids)
        await self._ws.send_str(json.dumps({"id": rid, "method": method, "params": params}))
        while True:
            msg = await asyncio.wait_for(self._ws.receive(), 30)
            data = json.loads(msg.data)
            if data.get("id") == rid:
                if "error" in data:
                    raise RuntimeError(f"{method}: {data['error']}")
                return data.get("result", {})

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 30, what: str = "") -> Any:
        """Evaluate until the value is truthy (a DOM node comes back as {}: test it against null); returns it."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = await self.evaluate(expression)
            if value:
                return value
            await asyncio.sleep(0.2)
        text = await self.evaluate("document.body ? document.body.innerText : ''")
        raise AssertionError(f"{what or expression} never came true in {timeout}s; the page says:\n{text[:3000]}")

    async def screenshot(self, path: str) -> None:
        data = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        with open(path, "wb") as fh:
            fh.write(base64.b64decode(data["data"]))

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        shutil.rmtree(self.profile, ignore_errors=True)


def number(text: str) -> int | None:
    m = re.search(r"\d+", text or "")
    return int(m[0]) if m else None
