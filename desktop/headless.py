"""Driving the real window without a person at it: the screenshot script, the layout tests and
the responsiveness measurement all open it on Qt's offscreen platform and wait on its event loop
the same way, so what one of them measures is what the others see."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Callable

from PySide6.QtWidgets import QApplication


def offscreen_screen(size: str) -> str:
    """A ``-platform`` argument: Qt's offscreen platform with one screen of ``size`` (WIDTHxHEIGHT)
    at 96 dpi, through the platform's config file. The screen is fixed when Qt starts, so a
    process shows one size only."""
    width, height = (int(v) for v in size.lower().split("x"))
    config = Path(tempfile.mkdtemp(prefix="specdeck-screen-")) / "screen.json"
    config.write_text(json.dumps({"screens": [{"name": f"screen{width}x{height}", "x": 0, "y": 0, "width": width,
                                               "height": height, "logicalDpi": 96, "logicalBaseDpi": 96,
                                               "dpr": 1}]}))
    return f"offscreen:configfile={config}"


def settle(app: QApplication, seconds: float = 1.0) -> None:
    """Let timers (charts, transcript) and layouts catch up before a grab or a measurement."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        app.processEvents()
        time.sleep(0.02)


def wait_until(app: QApplication, condition: Callable[[], bool], timeout_s: float) -> None:
    """Run the event loop until ``condition()`` holds; TimeoutError after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout_s} s")
        app.processEvents()
        time.sleep(0.002)
