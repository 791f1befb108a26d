"""Screenshots of the real window for the README: a conversation, then a comparison.

    xvfb-run -a python packaging/screenshots.py          # under Xvfb (Debian: apt install xvfb)
    QT_QPA_PLATFORM=offscreen python packaging/screenshots.py

Opens the main window on the bundled model in a fresh profile, asks two questions, runs the
comparison panel with ar and pld, and saves PNGs to assets/screenshots/.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("SPECDECK_DATA_DIR", tempfile.mkdtemp(prefix="specdeck-screens-"))


def main() -> None:
    from PySide6.QtCore import QSettings

    from backends.hardware.telemetry import Sampler
    from desktop.app import create_app
    from desktop.main_window import MainWindow
    from desktop.responsiveness import wait_until
    from desktop.store import ConversationStore

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-q4_1")
    p.add_argument("--out", type=Path, default=ROOT / "assets" / "screenshots")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    app = create_app()
    home = Path(os.environ["SPECDECK_DATA_DIR"])
    sampler = Sampler.for_this_machine(interval=0.25).start()
    window = MainWindow(sampler=sampler, store=ConversationStore(home / "c.sqlite3"),
                        settings=QSettings(str(home / "s.ini"), QSettings.Format.IniFormat), autoload=args.model)
    window.resize(1600, 1000)
    window.show()
    wait_until(app, lambda: window.model is not None, 300)
    wait_until(app, lambda: window.methods.advice is not None, 120)
    window.sampling.max_tokens.setValue(200)
    for question in ("Give me three tips for keeping houseplants alive, as a list.",
                     "Now write a Python function that waters a plant every 3 days."):
        window.chat.input.setPlainText(question)
        window.chat.send()
        wait_until(app, lambda: not window.chat.streaming, 300)
    window.chat.colour.setChecked(True)
    _settle(app)
    window.grab().save(str(args.out / "main-window.png"))
    window.chat.colour.setChecked(False)
    window.tabs.setCurrentWidget(window.compare)
    window.compare.prompt.setPlainText("Summarize in two sentences: The city council met on Tuesday to discuss the new "
                                       "park. The park will have a playground, a pond and a running track. Construction "
                                       "starts in May and ends in October.")
    window.compare.run()
    wait_until(app, lambda: not window.compare.running, 300)
    _settle(app)
    window.grab().save(str(args.out / "comparison.png"))
    window.close()
    sampler.stop()
    print(f"saved {args.out / 'main-window.png'} and {args.out / 'comparison.png'}")


def _settle(app, seconds: float = 1.0) -> None:
    """Let the charts' timer and layout catch up before grabbing."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        app.processEvents()
        time.sleep(0.02)


if __name__ == "__main__":
    main()
