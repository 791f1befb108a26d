"""Screenshots of the real window for the README: a conversation, then a comparison.

    xvfb-run -a python packaging/screenshots.py          # under Xvfb (Debian: apt install xvfb)
    QT_QPA_PLATFORM=offscreen python packaging/screenshots.py
    python packaging/screenshots.py --size 1366x768      # offscreen, as on a screen of that size

Opens the main window on the bundled model in a fresh profile (its welcome page first), asks two
questions, runs the comparison panel with ar and pld, and saves PNGs to assets/screenshots/. Without ``--size`` the
window is 1600x1000; with it, the window opens as it does for a new user on a screen of that size
(offscreen), and the PNGs are named after the size (``main-window-1366x768.png``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("SPECDECK_DATA_DIR", tempfile.mkdtemp(prefix="specdeck-screens-"))


def main() -> None:
    from PySide6.QtCore import QSettings, Qt

    from backends.hardware.telemetry import Sampler
    from desktop.app import create_app
    from desktop.main_window import MainWindow
    from desktop.headless import offscreen_screen, settle, wait_until
    from desktop.store import ConversationStore

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-q4_1")
    p.add_argument("--out", type=Path, default=ROOT / "assets" / "screenshots")
    p.add_argument("--size", default=None, help="WIDTHxHEIGHT of an offscreen screen to open the window on")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    app = create_app([sys.argv[0], "-platform", offscreen_screen(args.size)] if args.size else None)
    suffix = f"-{args.size}" if args.size else ""
    home = Path(os.environ["SPECDECK_DATA_DIR"])
    sampler = Sampler.for_this_machine(interval=0.25).start()
    window = MainWindow(sampler=sampler, store=ConversationStore(home / "c.sqlite3"),
                        settings=QSettings(str(home / "s.ini"), QSettings.Format.IniFormat), autoload=args.model)
    if not args.size:
        window.setWindowState(Qt.WindowState.WindowNoState)  # not maximized on a small default screen
        window.resize(1600, 1000)
    window.show()
    wait_until(app, lambda: window.model is not None, 300)
    wait_until(app, lambda: window.methods.advice is not None, 120)
    if window.welcome is not None:  # a fresh profile: the first-start page, then its one click
        wait_until(app, lambda: window.welcome.start.isEnabled(), 120)
        settle(app)
        window.grab().save(str(args.out / f"welcome{suffix}.png"))
        window.welcome.start.click()
    window.methods.select("pld")  # prompt lookup, so "Colour drafted tokens" has drafts to shade
    window.sampling.max_tokens.setValue(200)
    for question in ("Give me three tips for keeping houseplants alive, as a list.",
                     "Now write a Python function that waters a plant every 3 days."):
        window.chat.input.setPlainText(question)
        window.chat.send()
        wait_until(app, lambda: not window.chat.streaming, 300)
    window.chat.colour.setChecked(True)
    settle(app)
    window.grab().save(str(args.out / f"main-window{suffix}.png"))
    window.chat.colour.setChecked(False)
    window.tabs.setCurrentWidget(window.compare)
    window.compare.prompt.setPlainText("Summarize in two sentences: The city council met on Tuesday to discuss the new "
                                       "park. The park will have a playground, a pond and a running track. Construction "
                                       "starts in May and ends in October.")
    window.compare.run()
    wait_until(app, lambda: not window.compare.running, 300)
    settle(app)
    window.grab().save(str(args.out / f"comparison{suffix}.png"))
    window.close()
    sampler.stop()
    print(f"saved welcome{suffix}.png, main-window{suffix}.png and comparison{suffix}.png in {args.out}")


if __name__ == "__main__":
    main()
