"""Start the SpecDeck window: ``specdeck-gui`` or ``python -m desktop``.

    specdeck-gui                         # the bundled model, loaded and ready to chat
    specdeck-gui --model smollm2-135m-f16
    specdeck-gui --self-test             # load, answer one question, print the timings, exit 0 (see desktop.selftest)
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's BLAS threads would compete with llama.cpp

import argparse  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402

from concurrent.futures import Future, ThreadPoolExecutor  # noqa: E402

from PySide6.QtCore import QCoreApplication, QEvent, QEventLoop, QSettings, Qt  # noqa: E402
from PySide6.QtWidgets import QApplication, QProgressDialog  # noqa: E402

from backends.addons import activate  # noqa: E402
from backends.core.errors import BackendError  # noqa: E402
from backends.hardware.telemetry import Sampler  # noqa: E402
from backends.models import llama_runtime  # noqa: E402
from backends.models.catalog import DEFAULT_MODEL  # noqa: E402
from desktop import crashlog  # noqa: E402
from desktop.main_window import MainWindow  # noqa: E402
from desktop.store import ConversationStore  # noqa: E402


def create_app(argv: list[str] | None = None) -> QApplication:
    app = QApplication.instance() or QApplication(argv or sys.argv[:1])
    app.setOrganizationName("SpecDeck")
    app.setApplicationName("SpecDeck")
    app.setApplicationDisplayName("SpecDeck")
    return app  # type: ignore[return-value]


def probe_cpu_code(app: QApplication) -> None:
    """Find the llama.cpp CPU code that runs here before the window needs it, without freezing.

    The first start on a machine probes each variant in a child process (a few seconds); later
    starts read the cached verdict at once. A failure is left for the window to report (it
    is cached too, and llama.cpp then refuses to load with the same reason)."""
    with ThreadPoolExecutor(1, thread_name_prefix="specdeck-probe") as pool:
        future: Future = pool.submit(llama_runtime.choose)
        try:
            future.result(timeout=0.5)
            return
        except TimeoutError:
            pass
        except BackendError:
            return
        dialog = QProgressDialog("Checking which llama.cpp CPU code runs on this PC (once per install) ...", "", 0, 0)
        dialog.setCancelButton(None)
        dialog.setWindowTitle("SpecDeck")
        dialog.setWindowModality(Qt.WindowModality.ApplicationModal)
        dialog.show()
        while not future.done():
            app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 50)
            future_wait(future, 0.03)
        dialog.close()


def future_wait(future: Future, seconds: float) -> None:
    try:
        future.result(timeout=seconds)
    except Exception:  # noqa: BLE001 - only waiting here; the caller reads the outcome later
        pass


def start(argv: list[str] | None = None) -> tuple[QApplication, MainWindow, Sampler]:
    """Create the application and its window, shown; ``main`` runs its event loop."""
    parser = argparse.ArgumentParser(prog="specdeck-gui", description="The SpecDeck desktop window.")
    parser.add_argument("--model", default=None, help=f"model id or .gguf path to load (default: the last one, else {DEFAULT_MODEL})")
    parser.add_argument("--no-load", action="store_true", help="open without loading a model")
    args, qt_args = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("specdeck.llama").setLevel(logging.ERROR)
    previous_crash = crashlog.arm()
    app = create_app([sys.argv[0], *qt_args])
    probe_cpu_code(app)
    sampler = Sampler.for_this_machine(interval=0.5).start()
    settings = QSettings()
    if args.model:
        settings.setValue("model/last", args.model)
    window = MainWindow(sampler=sampler, store=ConversationStore(), settings=settings,
                        autoload=None if args.no_load else DEFAULT_MODEL)
    if previous_crash:
        window.show_error("Last session", previous_crash, sticky=True)
    window.show()
    return app, window, sampler


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    activate()  # torch installed as an add-on, for the PyTorch backend and training
    if "--self-test" in argv:
        return self_test(argv)
    app, window, sampler = start(argv)
    try:
        return app.exec()
    finally:
        dispose(window)
        sampler.stop()
        crashlog.disarm()


def dispose(window: MainWindow) -> None:
    """Close the window and delete it while the application still runs.

    Left to the interpreter's exit, PySide deletes every wrapped object in no particular order:
    a chart item whose scene was already gone sent events into half-destroyed Python objects and
    the process died with SIGSEGV after its work was done (seen when a failed load closed the
    window within a second). Deleting the window here lets Qt tear down its own tree first."""
    if window.isVisible():  # closed by the user already: its close event (worker shutdown) ran once
        window.close()
    window.deleteLater()
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)


def self_test(argv: list[str]) -> int:
    from desktop.selftest import run

    parser = argparse.ArgumentParser(prog="specdeck-gui --self-test")
    parser.add_argument("--self-test", action="store_true")
    parser.add_argument("--model", default=None, help=f"model id or .gguf path (default: {DEFAULT_MODEL})")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds before it counts as failed")
    args, qt_args = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("specdeck.llama").setLevel(logging.ERROR)
    return run(args.model, args.timeout, qt_args)


if __name__ == "__main__":
    sys.exit(main())
