"""Headless Chromium for the console tests, driven over the DevTools protocol (CDP) with
aiohttp's WebSocket client: no browser download, no driver package.

Uses the system's `chromium` (Debian's package; `.ci/run` installs it). Each Browser has a
fresh profile directory, so no cookie or cache outlives a test.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

from tests.harness.poll import eventually

START_TIMEOUT_S = 30.0
START_ATTEMPTS = 3
COMMAND_TIMEOUT_S = 30.0
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
)


def chromium_path() -> str:
    """The Chromium binary: $CHROMIUM, else `chromium` / `chromium-browser` on PATH."""
    for candidate in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser"):
        if candidate and (found := shutil.which(candidate)):
            return found
    raise RuntimeError(
        "headless Chromium is needed for the console tests: `apt-get install -y chromium` "
        "(.ci/run does it)"
    )


def _devtools_port(profile: Path) -> tuple[str, str] | None:
    """(port, browser path) from the DevToolsActivePort file Chromium writes once it listens."""
    try:
        lines = (profile / "DevToolsActivePort").read_text().split("\n")
    except OSError:
        return None
    return (lines[0], lines[1]) if len(lines) >= 2 and lines[1] else None


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


class CdpError(Exception):
    """A DevTools command failed."""


class Browser:
    """`async with Browser() as b:` then `page = await b.new_page()`."""

    def __init__(self) -> None:
        self._profile = Path(tempfile.mkdtemp(prefix="rollgate-chromium-"))
        self._process: asyncio.subprocess.Process | None = None
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Browser:
        # Chromium occasionally dies of SIGSEGV while it starts on a loaded machine (seen
        # here under a full suite, never once it listens): a start that ends before DevTools
        # opens is tried again, at most START_ATTEMPTS times; its stderr says why it died.
        for attempt in range(1, START_ATTEMPTS + 1):
            lines = await self._start(attempt)
            if lines is not None:
                break
        else:
            log = (self._profile / "chromium.stderr").read_text(errors="replace")[-2000:]
            raise RuntimeError(
                f"chromium exited before opening DevTools {START_ATTEMPTS} times "
                f"(last exit code {self._returncode()}); its stderr ended with:\n{log}"
            )
        port, path = lines
        self._http = aiohttp.ClientSession()
        self._ws = await self._http.ws_connect(
            f"ws://127.0.0.1:{port}{path}", max_msg_size=256 * 1024 * 1024
        )
        self._reader = asyncio.create_task(self._read())
        return self

    async def _start(self, attempt: int) -> tuple[str, str] | None:
        """Starts Chromium; (port, path) once DevTools listens, None if it exited first."""
        profile = self._profile / f"profile-{attempt}"
        with (self._profile / "chromium.stderr").open("ab") as stderr:
            self._process = await asyncio.create_subprocess_exec(
                chromium_path(), *FLAGS, f"--user-data-dir={profile}",
                "--remote-debugging-port=0", "about:blank",
                stdout=subprocess.DEVNULL, stderr=stderr, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        process = self._process

        def listening_or_exited() -> tuple[str, str] | str | None:
            return "exited" if process.returncode is not None else _devtools_port(profile)

        found = await eventually(
            listening_or_exited,
            timeout_s=START_TIMEOUT_S,
            interval_s=0.05,
            what="chromium opened its DevTools port",
        )
        return None if isinstance(found, str) else found

    def _returncode(self) -> int | None:
        return self._process.returncode if self._process is not None else None

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._ws is not None:
            await self._ws.close()
        if self._http is not None:
            await self._http.close()
        if self._process is not None and self._process.returncode is None:
            self._process.terminate()
            try:
                await asyncio.wait_for(self._process.wait(), 10)
            except TimeoutError:
                self._process.kill()
                await asyncio.wait_for(self._process.wait(), 10)
        shutil.rmtree(self._profile, ignore_errors=True)

    async def _read(self) -> None:
        assert self._ws is not None
        async for message in self._ws:
            data = json.loads(message.data)
            future = self._pending.pop(data.get("id", -1), None)
            if future is not None and not future.done():
                if "error" in data:
                    future.set_exception(CdpError(str(data["error"])))
                else:
                    future.set_result(data.get("result", {}))
            elif "method" in data:
                for listener in list(self._listeners):
                    listener(data)

    async def send(self, method: str, params: dict[str, Any] | None = None, *,
                   session: str | None = None) -> Any:  # fmt: skip
        """One CDP command (on a page's session when given); its result."""
        assert self._ws is not None
        message_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[message_id] = future
        message: dict[str, Any] = {"id": message_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        await self._ws.send_str(json.dumps(message))
        return await asyncio.wait_for(future, COMMAND_TIMEOUT_S)

    async def new_page(self) -> Page:
        """A new tab with Page, Runtime and Network events on."""
        target = await self.send("Target.createTarget", {"url": "about:blank"})
        attached = await self.send(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}
        )
        page = Page(self, attached["sessionId"])
        self._listeners.append(page.on_event)
        for domain in ("Page", "Runtime", "Network"):
            await page.send(f"{domain}.enable")
        return page


class Page:
    """One tab: navigate, evaluate JavaScript, wait for a condition, screenshot."""

    def __init__(self, browser: Browser, session: str) -> None:
        self._browser = browser
        self._session = session
        self.requested_urls: list[str] = []
        self.console_errors: list[str] = []
        self._loaded = asyncio.Event()

    def on_event(self, event: dict[str, Any]) -> None:
        """Records what the page requested and every exception it threw."""
        if event.get("sessionId") != self._session:
            return
        method, params = event["method"], event.get("params", {})
        if method == "Network.requestWillBeSent":
            self.requested_urls.append(params["request"]["url"])
        elif method == "Page.loadEventFired":
            self._loaded.set()
        elif method == "Runtime.exceptionThrown":
            self.console_errors.append(json.dumps(params.get("exceptionDetails", {}))[:500])

    async def send(self, method: str, params: dict[str, Any] | None = None) -> Any:
        """A CDP command on this tab."""
        return await self._browser.send(method, params, session=self._session)

    async def goto(self, url: str) -> None:
        """Navigates and waits for the load event."""
        self._loaded.clear()
        await self.send("Page.navigate", {"url": url})
        await asyncio.wait_for(self._loaded.wait(), COMMAND_TIMEOUT_S)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (promises awaited)."""
        result = await self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in result:
            raise CdpError(json.dumps(result["exceptionDetails"])[:1000])
        return result["result"].get("value")

    async def wait_for(self, expression: str, *, timeout_s: float = 20.0) -> Any:
        """Polls until the expression is truthy; its value."""

        async def value() -> Any:
            try:
                return await self.evaluate(expression)
            except CdpError:
                return None  # a navigation in between: the context is gone; try again

        return await eventually(value, timeout_s=timeout_s, interval_s=0.1, what=expression)

    async def wait_until(
        self, check: Callable[[], Awaitable[bool]], *, timeout_s: float = 20.0
    ) -> None:
        """Polls an async check (e.g. a navigation finished)."""
        await eventually(check, timeout_s=timeout_s, interval_s=0.1)

    async def url(self) -> str:
        """The page's current URL."""
        return str(await self.evaluate("window.location.href"))

    async def html(self) -> str:
        """The whole document as it is now."""
        return str(await self.evaluate("document.documentElement.outerHTML"))

    async def screenshot(self, path: Path) -> bytes:
        """A PNG of the whole page, written to `path`."""
        result = await self.send(
            "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}
        )
        data = base64.b64decode(result["data"])
        await asyncio.to_thread(_write, path, data)
        return data

    async def cookies(self) -> list[dict[str, Any]]:
        """Every cookie the browser holds."""
        result = await self.send("Network.getAllCookies")
        return list(result["cookies"])

    async def set_cookie(self, name: str, value: str, url: str) -> None:
        """Sets a cookie as if the server had (for forged and expired cookies)."""
        await self.send(
            "Network.setCookie", {"name": name, "value": value, "url": url, "path": "/console"}
        )
