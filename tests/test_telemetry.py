"""The telemetry sampler and energy per token, on this machine and on recorded power sources."""

from __future__ import annotations

import threading

import pytest

from backends.hardware.gpus import NvmlSession, sysfs_gpus
from backends.hardware.telemetry import Rapl, Sample, Sampler, SysfsSource, energy_joules, joules_per_token
from backends.hardware.types import GpuSample
from tests.hw_replay import load_replay


def sample(t, *, cpu_w=None, gpus=()):
    return Sample(t=t, cpu_pct=0.0, ram_used_bytes=0, cpu_power_w=cpu_w, gpus=tuple(gpus))


def gpu(index=0, *, w=None, mj=None):
    return GpuSample(index=index, vram_used_bytes=0, power_w=w, temperature_c=None, utilization_pct=None, energy_mj=mj)


def gpu_indices_this_machine_reads() -> list[int]:
    """The devices live readings should cover: NVML's devices when NVML opens (asked directly),
    else the AMD/Intel cards sysfs lists, else none."""
    try:
        import pynvml
    except ImportError:
        return list(range(len(sysfs_gpus())))
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return list(range(len(sysfs_gpus())))
    try:
        return list(range(pynvml.nvmlDeviceGetCount()))
    finally:
        pynvml.nvmlShutdown()


def test_sampler_on_this_machine_starts_publishes_and_stops():
    seen: list[Sample] = []
    got_two = threading.Event()

    def on_sample(s: Sample) -> None:
        seen.append(s)
        if len(seen) >= 2:
            got_two.set()

    sampler = Sampler.for_this_machine(interval=0.05)
    sampler.subscribe(on_sample)
    with sampler:
        assert got_two.wait(5)
        latest = sampler.latest()
        assert latest is not None and latest.ram_used_bytes > 0 and 0 <= latest.cpu_pct <= 100 * 64
        # One reading per GPU this machine has (none on most PCs); CPU power exactly when RAPL is readable.
        assert [g.index for g in latest.gpus] == gpu_indices_this_machine_reads()
        assert (latest.cpu_power_w is not None) == Rapl().available
    assert not any(t.name == "specdeck-telemetry" for t in threading.enumerate())
    assert sampler.history()[0].t < sampler.history()[-1].t
    with pytest.raises(AttributeError):
        latest.cpu_pct = 5  # samples are immutable


def test_sampler_reports_a_lost_gpu_and_keeps_sampling_fixture():
    """Two recorded RTX 3090s; GPU 1 falls off the bus after its first reading."""
    session = NvmlSession(load_replay("nvml_gpu_lost.json"))
    sampler = Sampler(interval=0.05, gpus=session, rapl=Rapl("/nonexistent"))
    first, second, third = sampler.sample_now(), sampler.sample_now(), sampler.sample_now()
    assert [g.index for g in first.gpus] == [0, 1] and first.status is None and first.power_w > 0
    assert [g.index for g in second.gpus] == [0] and "GPU 1 disappeared" in second.status
    assert third.ram_used_bytes > 0 and [g.index for g in third.gpus] == [0]
    sampler.stop()


def test_sysfs_source_reads_amd_cards_fixture():
    from pathlib import Path

    root = Path(__file__).parent / "data" / "hw" / "sysfs_rx7900xtx"
    s = Sampler(gpus=SysfsSource(str(root)), rapl=Rapl("/nonexistent")).sample_now()
    igpu, radeon = s.gpus  # the Intel iGPU has no hwmon and no VRAM of its own
    assert igpu.power_w is None and igpu.vram_used_bytes is None
    assert (radeon.power_w, radeon.temperature_c, radeon.vram_used_bytes) == (31.0, 41.0, 1280 * 1024**2)
    assert s.power_w == 31.0


def test_sampler_survives_a_source_that_raises():
    class Broken:
        def read_all(self):
            raise RuntimeError("driver wedged")

        def close(self):
            pass

    s = Sampler(gpus=Broken(), rapl=Rapl("/nonexistent")).sample_now()
    assert s.gpus == () and "driver wedged" in s.status and s.ram_used_bytes > 0


def write_rapl(root, energy_uj, *, max_uj=262143328850):
    zone = root / "intel-rapl:0"
    (zone / "intel-rapl:0:0").mkdir(parents=True, exist_ok=True)  # a core subzone, ignored
    (zone / "name").write_text("package-0\n")
    (zone / "energy_uj").write_text(f"{energy_uj}\n")
    (zone / "max_energy_range_uj").write_text(f"{max_uj}\n")
    (zone / "intel-rapl:0:0" / "name").write_text("core\n")
    (zone / "intel-rapl:0:0" / "energy_uj").write_text("5\n")


def test_rapl_power_and_wraparound_recorded_layout(tmp_path):
    write_rapl(tmp_path, 1_000_000)
    rapl = Rapl(tmp_path)
    assert rapl.available and rapl.power_w(10.0) is None  # the first read only sets the reference
    write_rapl(tmp_path, 31_000_000)
    assert rapl.power_w(11.0) == pytest.approx(30.0)
    write_rapl(tmp_path, 500_000, max_uj=31_500_000)  # the counter wrapped: +0.5 J +0.5 J
    assert rapl.power_w(12.0) == pytest.approx(1.0)


def test_unreadable_rapl_is_no_power(tmp_path):
    zone = tmp_path / "intel-rapl:0"
    zone.mkdir()
    (zone / "energy_uj").mkdir()  # a directory where the file should be: unreadable
    assert not Rapl(tmp_path).available


def test_energy_integrates_power():
    samples = [sample(t, cpu_w=20.0, gpus=[gpu(w=100.0)]) for t in (0.0, 0.5, 1.0, 1.5, 2.0)]
    assert energy_joules(samples, 0.25, 1.75) == pytest.approx(120.0 * 1.5)
    ramp = [sample(0.0, cpu_w=0.0), sample(2.0, cpu_w=100.0)]
    assert energy_joules(ramp, 0.0, 2.0) == pytest.approx(100.0)
    # Outside the sampled span the nearest reading is held flat.
    assert energy_joules([sample(1.0, cpu_w=10.0)], 0.0, 3.0) == pytest.approx(30.0)


def test_energy_uses_the_nvml_counter_when_every_gpu_has_one():
    # The counter says 50 J per second while the instantaneous power readings say 300 W.
    samples = [sample(t, gpus=[gpu(w=300.0, mj=int(1_000_000 + 50_000 * t))]) for t in (0.0, 1.0, 2.0)]
    assert energy_joules(samples, 0.5, 1.5) == pytest.approx(50.0)
    assert joules_per_token(samples, 0.0, 2.0, tokens=50) == pytest.approx(2.0)


def test_no_power_source_means_no_energy():
    samples = [sample(t) for t in (0.0, 1.0)]
    assert energy_joules(samples, 0.0, 1.0) is None
    assert joules_per_token(samples, 0.0, 1.0, tokens=10) is None
    assert joules_per_token([sample(0.0, cpu_w=5.0)], 0.0, 1.0, tokens=0) is None


def test_sampler_never_blocks_the_caller():
    """While a GPU source hangs inside the sampler thread, readers still get answers."""
    release, entered = threading.Event(), threading.Event()

    class Stuck:
        def read_all(self):
            entered.set()
            release.wait()
            return (), None

        def close(self):
            pass

    sampler = Sampler(interval=0.01, gpus=Stuck(), rapl=Rapl("/nonexistent")).start()
    assert entered.wait(5)
    reader = threading.Thread(target=lambda: (sampler.latest(), sampler.history()))
    reader.start()
    reader.join(timeout=5)
    stuck = reader.is_alive()
    release.set()
    sampler.stop()
    assert not stuck
