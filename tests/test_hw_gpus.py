"""GPU probes on recorded driver answers (tests/data/hw, see its README) and on this machine."""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import sys
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.hw_replay import NvmlReplay, load_replay
from backends.hardware import gpus
from backends.hardware.gpus import (
    GpuLost,
    NvmlSession,
    NvmlUnavailable,
    detect_gpus,
    nvidia_gpus,
    sysfs_gpus,
    windows_gpus,
)

HW = Path(__file__).parent / "data" / "hw"
GIB = 1024**3
MIB = 1024**2


@pytest.fixture
def pynvml():
    import pynvml

    return pynvml


@pytest.fixture
def replay():
    """replay("nvml_rtx4090.json", edit=None): a fresh NvmlReplay, the recording optionally edited first."""
    return load_replay


# -- NVML -----------------------------------------------------------------------------------------
def test_nvml_rtx4090_fixture(replay):
    nvml = replay("nvml_rtx4090.json")
    found, note = nvidia_gpus(nvml)
    assert note is None and nvml.shutdowns == 1
    (gpu,) = found
    assert (gpu.index, gpu.name, gpu.vendor, gpu.source) == (0, "NVIDIA GeForce RTX 4090", "nvidia", "nvml")
    assert gpu.vram_total_bytes == 24564 * MIB
    assert gpu.vram_used_bytes + gpu.vram_free_bytes == gpu.vram_total_bytes
    assert (gpu.driver_version, gpu.cuda_version, gpu.compute_capability) == ("570.133.07", "12.8", "8.9")
    assert gpu.power_w == pytest.approx(27.345) and gpu.power_limit_w == 450.0
    assert (gpu.temperature_c, gpu.utilization_pct) == (36.0, 2.0)
    assert (gpu.sm_clock_mhz, gpu.mem_clock_mhz, gpu.mem_bus_width_bits) == (210, 10501, 384)  # max mem clock
    assert gpu.bandwidth_bytes_s == pytest.approx(1.008e12, rel=1e-3)
    assert gpu.energy_mj == 2593815042
    assert gpu.pci_bus_id == "00000000:01:00.0"  # busId is a char array: bytes even in new bindings


def test_nvml_two_gpus_notsupported_fixture(replay):
    nvml = replay("nvml_two_gpus_notsupported.json")
    (gtx, rtx), note = nvidia_gpus(nvml)
    assert note is None and nvml.shutdowns == 1
    assert (gtx.name, rtx.name) == ("NVIDIA GeForce GTX 1080 Ti", "NVIDIA GeForce RTX 3060")  # from bytes
    assert gtx.driver_version == "470.256.02"
    assert gtx.cuda_version == "11.4"  # the binding has no _v2 call: the old name answers
    assert gtx.energy_mj is None and gtx.power_limit_w == 250.0  # Pascal has no energy counter
    assert rtx.power_limit_w is None and rtx.energy_mj == 781245993
    assert rtx.power_w == pytest.approx(14.285)
    assert (gtx.compute_capability, rtx.compute_capability) == ("6.1", "8.6")
    assert (gtx.vram_total_bytes, rtx.vram_total_bytes) == (11264 * MIB, 12 * GIB)
    # nvmlDeviceGetMemoryBusWidth is missing from this binding: no width, so no bandwidth guess
    assert gtx.mem_bus_width_bits is None and gtx.mem_clock_mhz == 5505 and gtx.bandwidth_bytes_s is None
    assert rtx.pci_bus_id == "00000000:05:00.0"


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        ("NVML_ERROR_LIBRARY_NOT_FOUND", "driver library not found"),
        ("NVML_ERROR_DRIVER_NOT_LOADED", "driver not loaded"),
        ("NVML_ERROR_NO_PERMISSION", "Insufficient Permissions"),
    ],
)
def test_nvml_init_failure_is_a_note(pynvml, error, reason):
    nvml = NvmlReplay(pynvml, {"nvmlInit": {"error": error}})
    assert nvidia_gpus(nvml) == ((), f"no NVIDIA GPU (NVML: {reason})")
    assert nvml.shutdowns == 0  # never initialised, nothing to shut down
    with pytest.raises(NvmlUnavailable, match=reason):
        NvmlSession(nvml)


def test_nvml_without_binding_is_a_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    assert nvidia_gpus() == ((), "no NVIDIA GPU (NVML: nvidia-ml-py is not installed)")


def test_nvml_driver_without_devices_is_a_note(pynvml):
    nvml = NvmlReplay(pynvml, {"devices": []})
    assert nvidia_gpus(nvml) == ((), "no NVIDIA GPU (NVML: the driver lists no devices)")
    assert nvml.shutdowns == 1


def test_nvml_gpu_lost_during_detection_fixture(replay):
    def lose_gpu1(recording):
        recording["devices"][1]["nvmlDeviceGetName"] = {"error": "NVML_ERROR_GPU_IS_LOST"}

    nvml = replay("nvml_gpu_lost.json", lose_gpu1)
    (gpu,), note = nvidia_gpus(nvml)
    assert gpu.index == 0 and gpu.vram_used_bytes == 18253611008
    assert gpu.compute_capability is None  # not in this recording: the call is missing, not an error
    assert note == "NVIDIA GPU 1 not readable (NVML: GPU is lost)"
    assert nvml.shutdowns == 1


def test_nvml_session_gpu_lost_fixture(replay, pynvml):
    nvml = replay("nvml_gpu_lost.json")
    with NvmlSession(nvml) as session:
        first = session.read(1)
        assert first.vram_used_bytes == 18186502144 and first.power_w == pytest.approx(341.877)
        assert (first.temperature_c, first.utilization_pct, first.energy_mj) == (69.0, 97.0, 905118823)
        with pytest.raises(GpuLost, match="GPU 1 disappeared") as lost:
            session.read(1)
        assert lost.value.index == 1 and isinstance(lost.value.__cause__, pynvml.NVMLError_GpuIsLost)
        assert session.read(0).power_w == pytest.approx(348.211)  # the other card reads on
    assert nvml.shutdowns == 1
    session.close()
    assert nvml.shutdowns == 1


def test_nvml_session_lost_on_a_live_query_fixture(replay):
    def lose_power(recording):
        recording["devices"][0]["nvmlDeviceGetPowerUsage"] = {"error": "NVML_ERROR_GPU_IS_LOST"}

    with NvmlSession(replay("nvml_rtx4090.json", lose_power)) as session, pytest.raises(GpuLost):
        session.read(0)


def test_nvml_session_not_supported_is_none_fixture(replay):
    with NvmlSession(replay("nvml_two_gpus_notsupported.json")) as session:
        sample = session.read(0)
    assert sample.energy_mj is None
    assert (sample.vram_used_bytes, sample.temperature_c, sample.utilization_pct) == (276561920, 31.0, 0.0)


# -- sysfs ----------------------------------------------------------------------------------------
def test_sysfs_rx7900xtx_fixture():
    igpu, radeon = sysfs_gpus(str(HW / "sysfs_rx7900xtx"))  # card1-DP-1 and renderD128 are not cards
    assert (igpu.index, igpu.name, igpu.vendor, igpu.source) == (0, "Intel GPU 0xa780", "intel", "sysfs")
    assert igpu.vram_total_bytes is None and igpu.power_w is None  # shared memory, no hwmon
    assert (radeon.index, radeon.name, radeon.vendor) == (1, "AMD Radeon RX 7900 XT / XTX", "amd")
    assert radeon.vram_total_bytes == 25753026560 and radeon.vram_used_bytes == 1280 * MIB
    assert radeon.vram_free_bytes == 25753026560 - 1280 * MIB
    assert (radeon.power_w, radeon.power_limit_w) == (31.0, 327.0)
    assert (radeon.temperature_c, radeon.utilization_pct) == (41.0, 4.0)
    assert radeon.pci_bus_id is None  # plain directory here; a real device path is tested below


def test_sysfs_garbage_fixture():
    (gpu,) = sysfs_gpus(str(HW / "sysfs_garbage"))  # card1: vendor "zz"; card2: NVIDIA, left to NVML
    assert gpu.name == "AMD Radeon RX 6800 / 6800 XT / 6900 XT"  # empty product_name
    assert gpu.vram_total_bytes is None and gpu.vram_used_bytes is None and gpu.vram_free_bytes is None
    assert gpu.utilization_pct is None  # gpu_busy_percent is a directory
    assert gpu.power_w == 48.0  # power1_average says N/A: power1_input
    assert gpu.power_limit_w is None and gpu.temperature_c is None  # binary junk, -ENODATA


def test_sysfs_symlinked_layout_dedupes_and_reads_pci_address(tmp_path):
    """Real sysfs: cardN/device is a link to the PCI device; two links to one device are one card."""
    pci = tmp_path / "devices" / "pci0000:00" / "0000:03:00.0"
    shutil.copytree(HW / "sysfs_rx7900xtx" / "class" / "drm" / "card1" / "device", pci)
    (pci / "product_name").write_text("AMD Radeon RX 7900 XTX\n")
    drm = tmp_path / "class" / "drm"
    for card in ("card1", "card2"):
        (drm / card).mkdir(parents=True)
        os.symlink(pci, drm / card / "device")
    (gpu,) = sysfs_gpus(str(tmp_path))
    assert (gpu.name, gpu.pci_bus_id) == ("AMD Radeon RX 7900 XTX", "0000:03:00.0")


def test_sysfs_without_drm_class(tmp_path):
    assert sysfs_gpus(str(tmp_path)) == ()


# -- Windows registry -----------------------------------------------------------------------------
def registry_keys() -> dict[str, dict[str, tuple[str, object]]]:
    """The recorded display class subkeys: {"0000": {value name: (type, data)}}, binary data as bytes."""
    raw = json.loads((HW / "windows_registry_adapters.json").read_text())
    def value(kind, data):
        return kind, bytes.fromhex(data) if kind == "REG_BINARY" else data

    return {key: {name: value(*recorded) for name, recorded in values.items()} for key, values in raw.items()}


def registry_adapters() -> list[dict[str, object]]:
    return [{name: data for name, (_kind, data) in values.items()} for values in registry_keys().values()]


def test_windows_registry_fixture():
    radeon, arc, geforce, uhd = windows_gpus(registry_adapters)  # Microsoft Basic Render Driver skipped
    assert [g.index for g in (radeon, arc, geforce, uhd)] == [0, 1, 2, 3]
    assert (radeon.name, radeon.vendor, radeon.source) == ("AMD Radeon RX 6800", "amd", "windows-registry")
    assert radeon.vram_total_bytes == 17163091968 > 4 * GIB  # the 64-bit value, not MemorySize's 0xfff00000
    assert radeon.driver_version == "31.0.24033.1003"
    assert (arc.name, arc.vendor) == ("Intel(R) Arc(TM) A770 Graphics", "intel")
    assert arc.vram_total_bytes == 16 * GIB  # REG_BINARY, 8 little-endian bytes
    assert (geforce.vendor, geforce.vram_total_bytes) == ("nvidia", 12878610432)
    assert (uhd.vendor, uhd.vram_total_bytes) == ("intel", 128 * MIB)  # only the DWORD MemorySize


def test_windows_registry_skips_vendors_fixture():
    found = windows_gpus(registry_adapters, skip_vendors=("nvidia",))
    assert [(g.index, g.vendor) for g in found] == [(0, "amd"), (1, "intel"), (2, "intel")]


def test_windows_registry_vendor_from_provider():
    adapter = {"DriverDesc": "Radeon Pro", "ProviderName": "Advanced Micro Devices, Inc."}
    (gpu,) = windows_gpus(lambda: [adapter])
    assert gpu.vendor == "amd" and gpu.vram_total_bytes is None


class FakeWinreg:
    """winreg's calls over the recorded class key; "Properties" is access-denied, as on Windows."""

    HKEY_LOCAL_MACHINE = "HKLM"
    TYPES = {"REG_SZ": 1, "REG_BINARY": 3, "REG_DWORD": 4, "REG_QWORD": 11}

    def __init__(self, keys):
        self._keys = keys

    def OpenKey(self, parent, name):
        if parent == self.HKEY_LOCAL_MACHINE:
            assert name == r"SYSTEM\CurrentControlSet\Control\Class\{4d36e968-e325-11ce-bfc1-08002be10318}"
            return nullcontext("class")
        if name == "Properties":
            raise PermissionError(13, "Access is denied")
        return nullcontext(self._keys[name])

    def EnumKey(self, key, i):
        return self._nth([*self._keys, "Properties"], i)

    def EnumValue(self, values, i):
        name, (kind, data) = self._nth(list(values.items()), i)
        return name, data, self.TYPES[kind]

    @staticmethod
    def _nth(items, i):
        if i >= len(items):
            raise OSError(259, "No more data is available")
        return items[i]


def test_windows_default_reader_fixture(monkeypatch):
    monkeypatch.setitem(sys.modules, "winreg", FakeWinreg(registry_keys()))
    monkeypatch.setattr(gpus, "sys", SimpleNamespace(platform="win32"))
    assert windows_gpus() == windows_gpus(registry_adapters)


def test_windows_default_reader_elsewhere(monkeypatch):
    monkeypatch.setattr(gpus, "sys", SimpleNamespace(platform="linux"))
    assert windows_gpus() == ()


# -- detect_gpus ----------------------------------------------------------------------------------
def test_detect_gpus_windows_fixture(monkeypatch, replay):
    nvml = replay("nvml_rtx4090.json")
    monkeypatch.setattr(gpus, "sys", SimpleNamespace(platform="win32"))
    monkeypatch.setattr(gpus, "nvidia_gpus", partial(nvidia_gpus, nvml))
    monkeypatch.setattr(gpus, "windows_gpus", partial(windows_gpus, registry_adapters))
    found, notes = detect_gpus()
    assert notes == ()
    assert [(g.index, g.source, g.vendor) for g in found] == [
        (0, "nvml", "nvidia"),
        (1, "windows-registry", "amd"),
        (2, "windows-registry", "intel"),
        (3, "windows-registry", "intel"),
    ]  # the registry's GeForce is the card NVML already reported


def test_detect_gpus_linux_fixture(monkeypatch, replay):
    monkeypatch.setattr(gpus, "sys", SimpleNamespace(platform="linux"))
    monkeypatch.setattr(gpus, "nvidia_gpus", partial(nvidia_gpus, replay("nvml_two_gpus_notsupported.json")))
    monkeypatch.setattr(gpus, "sysfs_gpus", partial(sysfs_gpus, str(HW / "sysfs_rx7900xtx")))
    found, notes = detect_gpus()
    assert notes == ()
    assert [(g.index, g.name) for g in found] == [
        (0, "NVIDIA GeForce GTX 1080 Ti"),
        (1, "NVIDIA GeForce RTX 3060"),
        (2, "Intel GPU 0xa780"),
        (3, "AMD Radeon RX 7900 XT / XTX"),
    ]


def test_detect_gpus_survives_a_failing_probe(monkeypatch, pynvml):
    def broken(root="/sys"):
        raise RuntimeError("surprise")

    no_driver = NvmlReplay(pynvml, {"nvmlInit": {"error": "NVML_ERROR_DRIVER_NOT_LOADED"}})
    monkeypatch.setattr(gpus, "sys", SimpleNamespace(platform="linux"))
    monkeypatch.setattr(gpus, "nvidia_gpus", partial(nvidia_gpus, no_driver))
    monkeypatch.setattr(gpus, "sysfs_gpus", broken)
    found, notes = detect_gpus()
    assert found == ()
    assert notes == ("no NVIDIA GPU (NVML: driver not loaded)", "sysfs probe failed: RuntimeError('surprise')")


@pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or os.path.exists("/sys/class/drm")
    or bool(ctypes.util.find_library("nvidia-ml")),
    reason="only meaningful on a Linux machine without GPUs (the CI container)",
)
def test_detect_gpus_on_this_machine_finds_none():
    found, notes = detect_gpus()
    assert found == ()
    assert any("no NVIDIA GPU" in note for note in notes), notes
