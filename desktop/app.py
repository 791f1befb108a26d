"""Start the SpecDeck window: ``specdeck-gui`` or ``python -m desktop``.

    specdeck-gui                         # the bundled model, loaded and ready to chat
    specdeck-gui --model smollm2-135m-f16
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's BLAS threads would compete with llama.cpp

import argparse  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402

from PySide6.QtCore import QSettings  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from backends.hardware.telemetry import Sampler  # noqa: E402
from backends.models.catalog import DEFAULT_MODEL  # noqa: E402
from desktop.main_window import MainWindow  # noqa: E402
from desktop.store import ConversationStore  # noqa: E402


def create_app(argv: list[str] | None = None) -> QApplication:
    app = QApplication.instance() or QApplication(argv or sys.argv[:1])
    app.setOrganizationName("SpecDeck")
    app.setApplicationName("SpecDeck")
    app.setApplicationDisplayName("SpecDeck")
    return app  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdeck-gui", description="The SpecDeck desktop window.")
    parser.add_argument("--model", default=None, help=f"model id or .gguf path to load (default: the last one, else {DEFAULT_MODEL})")
    parser.add_argument("--no-load", action="store_true", help="open without loading a model")
    args, qt_args = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("specdeck.llama").setLevel(logging.ERROR)
    app = create_app([sys.argv[0], *qt_args])
    sampler = Sampler.for_this_machine(interval=0.5).start()
    settings = QSettings()
    if args.model:
        settings.setValue("model/last", args.model)
    window = MainWindow(sampler=sampler, store=ConversationStore(), settings=settings,
                        autoload=None if args.no_load else DEFAULT_MODEL)
    window.show()
    try:
        return app.exec()
    finally:
        sampler.stop()


if __name__ == "__main__":
    sys.exit(main())
