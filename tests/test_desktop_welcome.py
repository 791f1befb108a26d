"""The first start (issue 21, "the first five minutes"): the welcome page says what was detected,
which model is loaded and how it fits, and the method recommended for it on this PC with the
method chooser's own reason; one click starts the chat, and the page is not shown again. The
real window, worker thread and bundled model, offscreen. Its layout at 1366x768 is checked in
tests/test_desktop_layout.py."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from backends.hardware.types import CpuInfo, GpuInfo, HardwareReport, RamInfo  # noqa: E402
from desktop.welcome import hardware_summary  # noqa: E402
from tests.desktop_kit import LOAD_TIMEOUT, close_window, home, open_window  # noqa: E402,F401


def test_first_start_says_what_was_found_and_chosen_and_one_click_starts_the_chat(qtbot, home):
    window = open_window(qtbot, home, first_start=True)
    page = window.welcome
    assert page is not None and window.tabs.currentWidget() is page
    qtbot.waitUntil(lambda: page.start.isEnabled(), timeout=LOAD_TIMEOUT)
    assert hardware_summary(window.hardware) in page.hardware.text().replace("&amp;", "&")
    chosen = window.methods.method()
    fit = window.methods.advice.fits[chosen].label
    assert window.model.name in page.model.text() and fit in page.model.text().replace("&amp;", "&")
    assert page.method.text() == window.methods.recommended.text()  # the chooser's own line: they never disagree
    assert f"<b>{chosen}</b>" in page.method.text()
    page.start.click()
    assert window.welcome is None and window.tabs.count() == 2
    assert window.tabs.currentWidget() is window.chat
    qtbot.waitUntil(window.chat.input.hasFocus, timeout=5000)
    close_window(window)

    again = open_window(qtbot, home, first_start=True)  # the same profile: a returning user
    assert again.welcome is None and again.tabs.currentWidget() is again.chat
    close_window(again)


def test_a_model_that_does_not_load_still_leaves_a_way_to_the_chat(qtbot, home, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    window = open_window(qtbot, home, first_start=True, autoload=None)
    page = window.welcome
    window.load_model(str(broken))
    qtbot.waitUntil(lambda: page.start.isEnabled(), timeout=LOAD_TIMEOUT)
    assert "not loaded" in page.model.text() and "Models dock" in page.model.text()
    page.start.click()
    assert window.tabs.currentWidget() is window.chat
    close_window(window)


def test_the_hardware_line_names_cpu_cores_vector_width_ram_and_each_gpu():
    cpu = CpuInfo(name="AMD Ryzen 7 7800X3D", vendor="amd", arch="x86_64", cores=8, threads=16,
                  flags=("avx", "avx2", "avx512f"))
    ram = RamInfo(total_bytes=32 * 2**30, available_bytes=20 * 2**30)
    gpu = GpuInfo(index=0, name="NVIDIA GeForce RTX 4090", vendor="nvidia", source="nvml", vram_total_bytes=24 * 2**30)
    assert (hardware_summary(HardwareReport("Linux", cpu, ram, (gpu,), None))
            == "AMD Ryzen 7 7800X3D · 8 cores · AVX-512 · 32.0 GiB RAM · NVIDIA GeForce RTX 4090 (24 GiB)")
    plain = CpuInfo(name="Intel Celeron N4020", vendor="intel", arch="x86_64", cores=2, threads=2, flags=("sse42",))
    assert (hardware_summary(HardwareReport("Linux", plain, RamInfo(4 * 2**30, 2**30), (), None))
            == "Intel Celeron N4020 · 2 cores · 4.0 GiB RAM · no GPU found (CPU only)")
