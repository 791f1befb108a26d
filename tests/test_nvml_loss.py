"""NVML disappearing mid-run with the window open: the GPU card is lost, or the driver is unloaded
and NVML answers "Uninitialized" to everything, while an answer streams and the charts update.

This machine has no NVIDIA GPU, so the failure is made at the pynvml boundary: pynvml's own
module functions are replaced, in this test only, by one card's worth of answers that start
raising pynvml's real error classes when the test says so. Everything above them is the app's:
``Sampler.for_this_machine`` (NvmlSession), the real window, the worker thread and the bundled
model. The charts must say what happened instead of dying, nothing may print a traceback, and the
app keeps answering.
"""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import itertools  # noqa: E402
import threading  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pynvml  # noqa: E402
import pytest  # noqa: E402

from backends.hardware.telemetry import Sampler  # noqa: E402
from tests.desktop_kit import ANSWER_TIMEOUT, Recorder, close_window, home, open_window, send  # noqa: E402,F401

GIB = 2**30


class FakeCard:
    """One RTX 4090 behind pynvml's function names. ``fail_with(error)``: from the next call on,
    every call raises that pynvml error (shutdown and init included); ``fail_with(None)``: the card
    answers again. Thread-safe: the sampler thread and the hardware probe both call it."""

    def __init__(self) -> None:
        self._error: type[pynvml.NVMLError] | None = None
        self._lock = threading.Lock()
        self._tick = itertools.count()
        self.calls = 0
        self.failed_calls = 0

    def fail_with(self, error: type[pynvml.NVMLError] | None) -> None:
        with self._lock:
            self._error = error

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        answers = {
            "nvmlInit": lambda: None,
            "nvmlShutdown": lambda: None,
            "nvmlDeviceGetCount": lambda: 1,
            "nvmlDeviceGetHandleByIndex": lambda index: ("handle", index),
            "nvmlSystemGetDriverVersion": lambda: "560.35.03",
            "nvmlSystemGetCudaDriverVersion_v2": lambda: 12060,
            "nvmlDeviceGetName": lambda handle: "NVIDIA GeForce RTX 4090",
            "nvmlDeviceGetMemoryInfo": lambda handle: SimpleNamespace(total=24 * GIB, free=20 * GIB, used=4 * GIB),
            "nvmlDeviceGetPowerUsage": lambda handle: 120_000 + 1000 * (next(self._tick) % 50),  # mW
            "nvmlDeviceGetTemperature": lambda handle, sensor: 55,
            "nvmlDeviceGetUtilizationRates": lambda handle: SimpleNamespace(gpu=40, memory=10),
            "nvmlDeviceGetTotalEnergyConsumption": lambda handle: 1_000_000 + 100 * next(self._tick),
        }
        unsupported = ("nvmlSystemGetCudaDriverVersion", "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetPciInfo",
                       "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetClockInfo", "nvmlDeviceGetMaxClockInfo",
                       "nvmlDeviceGetMemoryBusWidth")
        for name in unsupported:
            answers[name] = _raiser(pynvml.NVMLError_NotSupported)
        for name, answer in answers.items():
            monkeypatch.setattr(pynvml, name, self._guarded(answer))

    def _guarded(self, answer):
        def call(*args):
            with self._lock:
                self.calls += 1
                error = self._error
                if error is not None:
                    self.failed_calls += 1
            if error is not None:
                raise error()
            return answer(*args)

        return call


def _raiser(error):
    def call(*args):
        raise error()

    return call


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("error,says,comes_back", [
    (pynvml.NVMLError_GpuIsLost, "GPU is lost", True),
    (pynvml.NVMLError_Uninitialized, "driver unloaded or library gone", False),
], ids=["gpu-lost", "driver-unloaded"])
def test_nvml_failing_mid_answer_leaves_a_message_and_a_working_app(qtbot, home, monkeypatch, capfd, tmp_path,
                                                                    error, says, comes_back):
    card = FakeCard()
    card.install(monkeypatch)
    sampler = Sampler.for_this_machine(interval=0.05).start()
    assert sampler.has_gpu  # NvmlSession on the stand-in card
    window = open_window(qtbot, home, sampler=sampler)
    charts = window.charts
    try:
        assert charts.has_gpu and charts.gpu_status_shown() is None
        qtbot.waitUntil(lambda: charts.points("gpu_w") >= 3 and charts.points("vram_gib") >= 3, timeout=10_000)

        # NVML starts failing while an answer streams and the charts redraw.
        window.sampling.max_tokens.setValue(96)
        rec = Recorder(window)
        send(qtbot, window, "Count from 1 to 100, one number per line.")
        qtbot.waitUntil(lambda: rec.steps >= 3, timeout=ANSWER_TIMEOUT)
        card.fail_with(error)
        qtbot.waitUntil(lambda: charts.gpu_status_shown() is not None, timeout=10_000)
        message = charts.gpu_status_shown()
        assert "GPU 0" in message and says in message
        gpu_points, cpu_points = charts.points("gpu_w"), charts.points("cpu_pct")
        qtbot.waitUntil(lambda: charts.points("cpu_pct") >= cpu_points + 5, timeout=10_000)  # still charting
        assert charts.points("gpu_w") == gpu_points and card.failed_calls > 0
        qtbot.waitUntil(rec.done, timeout=ANSWER_TIMEOUT)
        assert rec.finished.reason in ("eos", "length") and rec.finished.stats.new_tokens > 0
        window.grab().save(str(tmp_path / f"nvml-{error.__name__}.png"))

        # The app keeps answering while NVML is gone.
        window.sampling.max_tokens.setValue(8)
        again = Recorder(window)
        send(qtbot, window, "Say hello.")
        qtbot.waitUntil(again.done, timeout=ANSWER_TIMEOUT)
        assert again.finished.reason in ("eos", "length")
        assert charts.gpu_status_shown() == message and window.error_text() == ""
        assert any(t.name == "specdeck-telemetry" for t in threading.enumerate())

        if comes_back:  # a card back after a driver reset reappears by itself, and the message goes
            card.fail_with(None)
            qtbot.waitUntil(lambda: charts.gpu_status_shown() is None, timeout=10_000)
            qtbot.waitUntil(lambda: charts.points("gpu_w") > gpu_points, timeout=10_000)
    finally:
        close_window(window)  # stops the sampler: NVML shutdown raising too must not matter
    assert not any(t.name == "specdeck-telemetry" for t in threading.enumerate())
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_charts_alone_show_the_message_and_clear_it_when_the_card_answers(qtbot, monkeypatch):
    """The same at the charts' level, with nothing but the sampler behind them."""
    from desktop.charts import LiveCharts

    card = FakeCard()
    card.install(monkeypatch)
    with Sampler.for_this_machine(interval=0.02) as sampler:
        charts = LiveCharts(sampler, has_gpu=sampler.has_gpu)
        qtbot.addWidget(charts)
        charts.show()
        qtbot.waitUntil(lambda: charts.points("gpu_w") >= 2, timeout=5000)
        for error in (pynvml.NVMLError_GpuIsLost, pynvml.NVMLError_Uninitialized):
            card.fail_with(error)
            qtbot.waitUntil(lambda: charts.gpu_status_shown() is not None, timeout=5000)
            assert charts.messages["gpu"] == charts.gpu_status_shown() and "GPU 0 disappeared" in charts.messages["gpu"]
            card.fail_with(None)
            qtbot.waitUntil(lambda: charts.gpu_status_shown() is None, timeout=5000)
            assert charts.messages["gpu"] is None
