"""How responsive is the window while it generates? A benchmark, not a test.

    QT_QPA_PLATFORM=offscreen python -m desktop.responsiveness --model smollm2-135m-f16

- GUI-thread blocking: a 10 ms timer on the GUI thread records how late each tick fires while
  the worker streams answers and runs a comparison; the worst lateness is the longest time the
  GUI thread could not react (the bar: 50 ms).
- Stop latency: an answer is started, and after a few streamed steps Stop (what Esc does) is
  pressed; the time until the worker reports the answer finished is measured (the bar: 200 ms).
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import statistics
import tempfile
import time
from pathlib import Path

from PySide6.QtCore import QElapsedTimer, QSettings, QTimer

from backends.core.types import Finished, Step
from backends.hardware.telemetry import Sampler
from desktop.app import create_app
from desktop.headless import wait_until
from desktop.main_window import MainWindow
from desktop.store import ConversationStore

TICK_MS = 10


class Probe:
    """Lateness of a 10 ms GUI-thread timer: how long the GUI thread was busy elsewhere."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self.clock = QElapsedTimer()
        self.timer = QTimer()
        self.timer.setInterval(TICK_MS)
        self.timer.timeout.connect(self._tick)

    def start(self) -> None:
        self.clock.start()
        self.timer.start()

    def _tick(self) -> None:
        self.gaps.append(self.clock.restart() - TICK_MS)

    def stop(self) -> None:
        self.timer.stop()


def measure(model: str, *, answers: int, stops: int, max_tokens: int) -> dict:
    app = create_app()
    home = Path(tempfile.mkdtemp(prefix="specdeck-responsiveness-"))
    sampler = Sampler.for_this_machine(interval=0.5).start()
    window = MainWindow(sampler=sampler, store=ConversationStore(home / "c.sqlite3"),
                        settings=QSettings(str(home / "s.ini"), QSettings.Format.IniFormat), autoload=model)
    window.show()
    wait_until(app, lambda: window.model is not None, 300)
    wait_until(app, lambda: window.methods.advice is not None, 120)
    state = {"steps": 0, "finished": None, "t_finish": 0.0}

    def on_event(ev) -> None:
        if isinstance(ev.event, Step):
            state["steps"] += 1
        elif isinstance(ev.event, Finished):
            state["finished"], state["t_finish"] = ev.event, time.perf_counter()

    window.worker.answer_event.connect(on_event)  # called on the worker thread, as the event is sent
    window.worker.failed.connect(lambda failure: state.update(failure=failure))

    def done() -> bool:
        """The worker finished and the window has shown it (its queued events are processed)."""
        return state["finished"] is not None and not window.chat.streaming

    def answer(text: str, tokens: int) -> None:
        state.update(steps=0, finished=None)
        window.chat.new_chat()  # each answer on its own, so the conversation never outgrows the context
        window.sampling.max_tokens.setValue(tokens)
        window.chat.input.setPlainText(text)
        window.chat.send()

    probe = Probe()
    probe.start()
    for i in range(answers):
        answer(f"Write a short story about a lighthouse keeper, part {i + 1}.", max_tokens)
        wait_until(app, done, 600)
    window.compare.prompt.setPlainText("Summarize: the council met on Tuesday to plan the new park and its pond.")
    window.compare.run()
    wait_until(app, lambda: not window.compare.running, 600)
    probe.stop()

    latencies = []
    while len(latencies) < stops:
        answer(f"Write a long, detailed essay on the history of the Roman Empire, chapter {len(latencies) + 1}.", 3000)
        wait_until(app, lambda: state["steps"] >= 5 + len(latencies) % 7 or state["finished"] is not None
                   or state.get("failure") is not None, 60)
        if state.get("failure") is not None:
            raise RuntimeError(f"the answer failed: {state['failure']}")
        if state["finished"] is not None:  # the model ended the answer before Stop could be pressed
            wait_until(app, done, 60)
            continue
        pressed = time.perf_counter()
        window.stop()
        wait_until(app, lambda: state["finished"] is not None, 60)
        wait_until(app, done, 60)
        latencies.append(state["t_finish"] - pressed)
    window.close()
    sampler.stop()
    gaps = sorted(probe.gaps)
    return {
        "model": model, "ticks": len(gaps), "worst_gui_block_ms": gaps[-1] if gaps else float("nan"),
        "p99_gui_block_ms": gaps[int(0.99 * (len(gaps) - 1))] if gaps else float("nan"),
        "stop_latency_ms": [1000 * x for x in latencies],
        "stop_latency_median_ms": 1000 * statistics.median(latencies),
        "stop_latency_max_ms": 1000 * max(latencies),
    }


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 PID prints every thread's stack
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-f16")
    p.add_argument("--answers", type=int, default=3)
    p.add_argument("--stops", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args()
    r = measure(args.model, answers=args.answers, stops=args.stops, max_tokens=args.max_tokens)
    print(f"{r['model']}: GUI thread blocked at most {r['worst_gui_block_ms']:.1f} ms (99th percentile "
          f"{r['p99_gui_block_ms']:.1f} ms over {r['ticks']} ticks of a {TICK_MS} ms timer) while streaming "
          f"{args.answers} answers and a comparison; Stop returned in median {r['stop_latency_median_ms']:.0f} ms, "
          f"max {r['stop_latency_max_ms']:.0f} ms over {args.stops} stops")


if __name__ == "__main__":
    main()
