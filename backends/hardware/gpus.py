"""GPU probes: NVIDIA through NVML, AMD and Intel through Linux sysfs or the Windows registry.

Each probe reads only what the driver already exposes (no CUDA, ROCm or Vulkan runtime is loaded)
and turns anything missing, unsupported or unparsable into ``None`` for that one field: a GeForce
without an energy counter, a sysfs file that says "N/A" or a registry value of an odd type costs
a field, never the report.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from dataclasses import replace
from typing import Any

from backends.hardware.types import GpuInfo, GpuSample

_PCI_VENDORS = {0x10DE: "nvidia", 0x1002: "amd", 0x8086: "intel"}


# -- NVIDIA: NVML ---------------------------------------------------------------------------------
class NvmlUnavailable(RuntimeError):
    """NVML could not be opened: no NVIDIA driver, no nvidia-ml-py, or driver and library disagree."""


class GpuLost(RuntimeError):
    """A device that answered before stopped answering (fell off the bus, driver reset, eGPU unplugged).

    Its own type so that a sampler can say "GPU disappeared" and keep sampling the other cards.
    """

    def __init__(self, index: int, reason: str):
        super().__init__(f"GPU {index} disappeared (NVML: {reason})")
        self.index = index


def nvidia_gpus(nvml: Any = None) -> tuple[tuple[GpuInfo, ...], str | None]:
    """NVIDIA devices and a note when there are none (or some could not be read).

    A machine without the NVIDIA driver is the common case, not an error, so a failing
    ``nvmlInit`` becomes the note ``"no NVIDIA GPU (NVML: <reason>)"``. ``nvml`` is the pynvml
    module, or in tests any object with the same function names and constants.
    """
    try:
        nvml = _open_nvml(nvml)
    except NvmlUnavailable as exc:
        return (), f"no NVIDIA GPU (NVML: {exc})"
    try:
        return _nvml_devices(nvml)
    except nvml.NVMLError as exc:  # the device count itself failed
        return (), f"no NVIDIA GPU (NVML: {exc})"
    finally:
        _close_nvml(nvml)


class NvmlSession:
    """NVML held open for a telemetry sampler.

    ``nvmlInit`` walks every device and costs far more than one reading, so a sampler that polls
    several times a second opens NVML once here. Raises NvmlUnavailable when NVML cannot be opened.
    """

    def __init__(self, nvml: Any = None):
        self._nvml = _open_nvml(nvml)
        self._handles: dict[int, Any] = {}
        self._n_devices: int | None = None
        self._closed = False

    def read(self, index: int) -> GpuSample:
        """Live values of NVML device ``index``.

        Memory info works on every NVIDIA card, so any NVML error there (and GPU_IS_LOST
        anywhere) means the device is gone: GpuLost, which the caller reports before reading on.
        """
        nvml = self._nvml
        try:
            handle = self._handle(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            return GpuSample(index=index, vram_used_bytes=memory.used, **_live_fields(nvml, handle))
        except nvml.NVMLError as exc:
            raise GpuLost(index, _nvml_reason(nvml, exc)) from exc

    def read_all(self) -> tuple[tuple[GpuSample, ...], str | None]:
        """Every device that answers, and what went wrong with those that did not.

        Lost devices are asked again at every call, so a card that comes back after a driver
        reset reappears in the samples by itself.
        """
        samples, problems = [], []
        for index in range(self._count()):
            try:
                samples.append(self.read(index))
            except GpuLost as exc:
                self._handles.pop(index, None)
                problems.append(str(exc))
        return tuple(samples), "; ".join(problems) or None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _close_nvml(self._nvml)

    def __enter__(self) -> NvmlSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _count(self) -> int:
        if self._n_devices is None:
            try:
                self._n_devices = int(self._nvml.nvmlDeviceGetCount())
            except self._nvml.NVMLError:
                return 0
        return self._n_devices

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            self._handles[index] = self._nvml.nvmlDeviceGetHandleByIndex(index)
        return self._handles[index]


def _open_nvml(nvml: Any) -> Any:
    """Import (lazily: most machines have no NVIDIA card) and initialise NVML."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as exc:
            raise NvmlUnavailable("nvidia-ml-py is not installed") from exc
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise NvmlUnavailable(_nvml_reason(nvml, exc)) from exc
    return nvml


def _nvml_reason(nvml: Any, exc: Exception) -> str:
    """Plain words for the everyday failures; pynvml's own text for the rest.

    Uninitialized in the middle of a run means NVML went away under the sampler (driver unloaded
    or reinstalled, library gone); GPU_IS_LOST keeps pynvml's "GPU is lost".
    """
    plain = {
        nvml.NVML_ERROR_LIBRARY_NOT_FOUND: "driver library not found",
        nvml.NVML_ERROR_DRIVER_NOT_LOADED: "driver not loaded",
        nvml.NVML_ERROR_UNINITIALIZED: "driver unloaded or library gone",
    }
    return plain.get(getattr(exc, "value", None), str(exc))


def _close_nvml(nvml: Any) -> None:
    """Shut NVML down; a failure here must not hide the readings already taken."""
    with suppress(nvml.NVMLError):
        nvml.nvmlShutdown()


def _nvml_devices(nvml: Any) -> tuple[tuple[GpuInfo, ...], str | None]:
    count = nvml.nvmlDeviceGetCount()
    if count == 0:
        return (), "no NVIDIA GPU (NVML: the driver lists no devices)"
    driver = _text(_query(nvml, "nvmlSystemGetDriverVersion"))
    cuda = _cuda_version(nvml)
    gpus: list[GpuInfo] = []
    notes: list[str] = []
    for index in range(count):
        try:
            gpus.append(_nvml_device(nvml, index, driver, cuda))
        except nvml.NVMLError as exc:  # lost during detection, or no handle (permissions)
            notes.append(f"NVIDIA GPU {index} not readable (NVML: {exc})")
    return tuple(gpus), "; ".join(notes) or None


def _nvml_device(nvml: Any, index: int, driver: str | None, cuda: str | None) -> GpuInfo:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = _query(nvml, "nvmlDeviceGetMemoryInfo", handle)
    capability = _query(nvml, "nvmlDeviceGetCudaComputeCapability", handle)
    pci = _query(nvml, "nvmlDeviceGetPciInfo", handle)
    return GpuInfo(
        index=index,
        name=_text(_query(nvml, "nvmlDeviceGetName", handle)) or "NVIDIA GPU",
        vendor="nvidia",
        source="nvml",
        vram_total_bytes=getattr(memory, "total", None),
        vram_free_bytes=getattr(memory, "free", None),
        vram_used_bytes=getattr(memory, "used", None),
        driver_version=driver,
        cuda_version=cuda,
        compute_capability="{}.{}".format(*capability) if capability else None,
        power_limit_w=_ratio(_query(nvml, "nvmlDeviceGetEnforcedPowerLimit", handle), 1000),
        sm_clock_mhz=_query(nvml, "nvmlDeviceGetClockInfo", handle, nvml.NVML_CLOCK_SM),
        # The maximum, not the current memory clock: an idle card drops to a few hundred MHz, and
        # bandwidth_bytes_s needs the clock the card runs at under load (10501 MHz on an RTX 4090).
        mem_clock_mhz=_query(nvml, "nvmlDeviceGetMaxClockInfo", handle, nvml.NVML_CLOCK_MEM),
        mem_bus_width_bits=_query(nvml, "nvmlDeviceGetMemoryBusWidth", handle),
        pci_bus_id=_text(getattr(pci, "busId", None)),
        **_live_fields(nvml, handle),
    )


def _live_fields(nvml: Any, handle: Any) -> dict[str, Any]:
    """The values that change while a model runs; shared by detection and NvmlSession."""
    utilization = _query(nvml, "nvmlDeviceGetUtilizationRates", handle)
    return {
        "power_w": _ratio(_query(nvml, "nvmlDeviceGetPowerUsage", handle), 1000),  # mW
        "temperature_c": _ratio(_query(nvml, "nvmlDeviceGetTemperature", handle, nvml.NVML_TEMPERATURE_GPU)),
        "utilization_pct": _ratio(getattr(utilization, "gpu", None)),
        "energy_mj": _query(nvml, "nvmlDeviceGetTotalEnergyConsumption", handle),
    }


def _cuda_version(nvml: Any) -> str | None:
    """Highest CUDA version the driver supports, 12080 -> "12.8" (older bindings lack the _v2 name)."""
    for name in ("nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion"):
        version = _query(nvml, name)
        if version:
            return f"{version // 1000}.{version % 1000 // 10}"
    return None


def _query(nvml: Any, name: str, *args: Any) -> Any:
    """One NVML call, or None when this card, driver or binding lacks it.

    NotSupported (GeForce without an energy counter), NoPermission (containers) and
    FunctionNotFound (old driver) are routine and cost one field. GPU_IS_LOST is re-raised: the
    caller drops the device instead of reporting a dead card as a card with blank fields.
    """
    function = getattr(nvml, name, None)
    if function is None:  # the installed nvidia-ml-py predates this call
        return None
    try:
        return function(*args)
    except nvml.NVMLError as exc:
        if exc.value == nvml.NVML_ERROR_GPU_IS_LOST:
            raise
        return None


# -- AMD and Intel on Linux: sysfs ----------------------------------------------------------------
_CARD = re.compile(r"card(\d+)")
_VENDOR_LABELS = {"amd": "AMD", "intel": "Intel"}
_PCI_ADDRESS = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
# Names for cards whose board has no product_name; anything else reads "AMD GPU 0x1234".
_KNOWN_DEVICES = {
    (0x1002, 0x744C): "AMD Radeon RX 7900 XT / XTX",
    (0x1002, 0x73BF): "AMD Radeon RX 6800 / 6800 XT / 6900 XT",
    (0x8086, 0x56A0): "Intel Arc A770",
    (0x8086, 0x56A1): "Intel Arc A750",
}


def sysfs_gpus(root: str = "/sys") -> tuple[GpuInfo, ...]:
    """AMD and Intel cards from Linux sysfs (amdgpu, i915, xe), read as plain files.

    NVIDIA cards are left to NVML, which knows more about them; other vendors (a server BMC's
    ASPEED chip, virtio, simpledrm) cannot run a model and are left out as well.
    """
    gpus: list[GpuInfo] = []
    seen: set[str] = set()
    for card in _card_dirs(os.path.join(root, "class", "drm")):
        device = os.path.realpath(os.path.join(card, "device"))
        if device in seen:
            continue
        seen.add(device)
        gpu = _sysfs_card(device, len(gpus))
        if gpu is not None:
            gpus.append(gpu)
    return tuple(gpus)


def _card_dirs(drm: str) -> list[str]:
    """card0, card1, ... in numeric order; connectors (card1-DP-1) and render nodes left out."""
    try:
        names = os.listdir(drm)
    except OSError:
        return []
    numbered = sorted((int(match[1]), name) for name in names if (match := _CARD.fullmatch(name)))
    return [os.path.join(drm, name) for _, name in numbered]


def _sysfs_card(device: str, index: int) -> GpuInfo | None:
    vendor_id = _read_int(os.path.join(device, "vendor"), 16)
    vendor = _PCI_VENDORS.get(vendor_id)
    if vendor not in ("amd", "intel"):
        return None
    total = _read_int(os.path.join(device, "mem_info_vram_total"))
    used = _read_int(os.path.join(device, "mem_info_vram_used"))
    power = _hwmon_int(device, "power1_average")
    if power is None:  # newer kernels give some cards (RDNA3) only power1_input
        power = _hwmon_int(device, "power1_input")
    address = os.path.basename(device)
    return GpuInfo(
        index=index,
        name=_sysfs_name(device, vendor_id, vendor),
        vendor=vendor,
        source="sysfs",
        vram_total_bytes=total,
        vram_free_bytes=total - used if total is not None and used is not None else None,
        vram_used_bytes=used,
        power_w=_ratio(power, 1e6),  # microwatts
        power_limit_w=_ratio(_hwmon_int(device, "power1_cap"), 1e6),
        temperature_c=_ratio(_hwmon_int(device, "temp1_input"), 1000),  # millidegrees
        utilization_pct=_ratio(_read_int(os.path.join(device, "gpu_busy_percent"))),
        pci_bus_id=address if _PCI_ADDRESS.fullmatch(address) else None,
    )


def _sysfs_name(device: str, vendor_id: int, vendor: str) -> str:
    """product_name when the board's FRU has one (mostly workstation cards), else the id table."""
    product = _read_text(os.path.join(device, "product_name"))
    if product:
        return product
    device_id = _read_int(os.path.join(device, "device"), 16)
    if device_id is None:
        return f"{_VENDOR_LABELS[vendor]} GPU"
    return _KNOWN_DEVICES.get((vendor_id, device_id), f"{_VENDOR_LABELS[vendor]} GPU 0x{device_id:04x}")


def _hwmon_int(device: str, name: str) -> int | None:
    """``name`` from the card's first hwmon directory that has it (amdgpu has one per card)."""
    hwmon_root = os.path.join(device, "hwmon")
    try:
        hwmons = sorted(os.listdir(hwmon_root))
    except OSError:
        return None
    for hwmon in hwmons:
        value = _read_int(os.path.join(hwmon_root, hwmon, name))
        if value is not None:
            return value
    return None


def _read_text(path: str) -> str | None:
    """A sysfs file's text; None when absent, unreadable (EACCES, ENODATA, a directory), empty or binary."""
    try:
        with open(path, encoding="ascii") as file:
            text = file.read(4096).strip()
    except (OSError, ValueError):
        return None
    return text or None


def _read_int(path: str, base: int = 10) -> int | None:
    text = _read_text(path)
    try:
        return int(text, base) if text else None
    except ValueError:  # "N/A", "-ENODATA", half-written values
        return None


# -- Windows: the display adapters' registry keys -------------------------------------------------
_DISPLAY_CLASS = r"SYSTEM\CurrentControlSet\Control\Class\{4d36e968-e325-11ce-bfc1-08002be10318}"
_SOFTWARE_ADAPTERS = {"Microsoft Basic Render Driver"}
_PCI_VENDOR_IN_ID = re.compile(r"ven_([0-9a-f]{4})", re.IGNORECASE)
_PROVIDERS = (("advanced micro devices", "amd"), ("amd", "amd"), ("intel", "intel"), ("nvidia", "nvidia"))


def windows_gpus(
    read_adapters: Callable[[], list[dict[str, Any]]] | None = None,
    skip_vendors: Iterable[str] = (),
) -> tuple[GpuInfo, ...]:
    """Graphics cards and their VRAM from the registry, for the cards NVML does not cover.

    VRAM is the 64-bit ``HardwareInformation.qwMemorySize`` the driver writes at install, else
    the 32-bit ``HardwareInformation.MemorySize``. WMI's ``Win32_VideoController.AdapterRAM`` is
    never used: it is a 32-bit field and reads 4 GB (or a wrapped value) on any bigger card.
    ``read_adapters`` returns one dict of registry values per adapter key (tests pass recorded
    ones); ``skip_vendors`` drops cards another probe already reported, e.g. ``("nvidia",)``.
    The class key can keep entries of cards that were removed since; they are listed too.
    """
    skip = set(skip_vendors)
    gpus: list[GpuInfo] = []
    for values in (read_adapters or _registry_adapters)():
        gpu = _registry_adapter(values, len(gpus))
        if gpu is not None and gpu.vendor not in skip:
            gpus.append(gpu)
    return tuple(gpus)


def _registry_adapter(values: dict[str, Any], index: int) -> GpuInfo | None:
    name = _text(values.get("DriverDesc"))
    device_id = (_text(values.get("MatchingDeviceId")) or "").lower()
    # Software renderers and virtual displays (root\..., swd\...) have no memory of their own.
    if not name or name in _SOFTWARE_ADAPTERS or device_id.startswith(("root\\", "swd\\")):
        return None
    return GpuInfo(
        index=index,
        name=name,
        vendor=_registry_vendor(device_id, _text(values.get("ProviderName")) or ""),
        source="windows-registry",
        vram_total_bytes=_registry_vram(values),
        driver_version=_text(values.get("DriverVersion")),
    )


def _registry_vendor(device_id: str, provider: str) -> str:
    """From the PCI id in MatchingDeviceId ("pci\\ven_1002&dev_73bf"), else the driver's provider."""
    match = _PCI_VENDOR_IN_ID.search(device_id)
    if match:
        return _PCI_VENDORS.get(int(match[1], 16), "other")
    provider = provider.lower()
    return next((vendor for word, vendor in _PROVIDERS if word in provider), "other")


def _registry_vram(values: dict[str, Any]) -> int | None:
    for name in ("HardwareInformation.qwMemorySize", "HardwareInformation.MemorySize"):
        size = _registry_int(values.get(name))
        if size:
            return size
    return None


def _registry_int(value: Any) -> int | None:
    """REG_QWORD and REG_DWORD come back from winreg as int, REG_BINARY as little-endian bytes."""
    if isinstance(value, bytes):
        return int.from_bytes(value, "little") if len(value) in (4, 8) else None
    return value if isinstance(value, int) else None


def _registry_adapters() -> list[dict[str, Any]]:
    """Values of each numbered subkey (0000, 0001, ...) of the display adapter class key."""
    if sys.platform != "win32":
        return []
    import winreg

    adapters = []
    with suppress(OSError), winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, _DISPLAY_CLASS) as display_class:
        for name in _enumerate(winreg.EnumKey, display_class):
            if not name.isdigit():  # "Properties" (access denied) and other non-adapter subkeys
                continue
            with suppress(OSError), winreg.OpenKey(display_class, name) as key:
                adapters.append({value: data for value, data, _type in _enumerate(winreg.EnumValue, key)})
    return adapters


def _enumerate(enum: Callable[[Any, int], Any], key: Any) -> Iterator[Any]:
    """winreg.EnumKey / EnumValue until they run out, which they signal with OSError."""
    for i in itertools.count():
        try:
            yield enum(key, i)
        except OSError:
            return


# -- all of them ----------------------------------------------------------------------------------
def detect_gpus() -> tuple[tuple[GpuInfo, ...], tuple[str, ...]]:
    """Every GPU found, numbered 0..n-1 with NVIDIA first, and notes on what was not found. Never raises."""
    notes: list[str] = []

    def nvml() -> tuple[GpuInfo, ...]:
        gpus, note = nvidia_gpus()
        if note:
            notes.append(note)
        return gpus

    found = _probe(notes, "NVML", nvml)
    if sys.platform.startswith("linux"):
        found += _probe(notes, "sysfs", sysfs_gpus)
    elif sys.platform == "win32":
        skip = ("nvidia",) if found else ()
        found += _probe(notes, "registry", lambda: windows_gpus(skip_vendors=skip))
    return tuple(replace(gpu, index=i) for i, gpu in enumerate(found)), tuple(notes)


def _probe(notes: list[str], label: str, probe: Callable[[], tuple[GpuInfo, ...]]) -> tuple[GpuInfo, ...]:
    """Run one probe; a surprise inside it becomes a note, because the hardware report must come out."""
    try:
        return probe()
    except Exception as exc:  # noqa: BLE001 - any failure of one probe must leave the others
        notes.append(f"{label} probe failed: {exc!r}")
        return ()


# -- small converters -----------------------------------------------------------------------------
def _text(value: Any) -> str | None:
    """A string from NVML or the registry: older nvidia-ml-py releases return bytes, newer ones str."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if not isinstance(value, str):
        return None
    return value.strip("\x00 ") or None


def _ratio(value: int | None, divisor: float = 1) -> float | None:
    """A raw driver integer in the unit GpuInfo uses (mW -> W, millidegrees -> C, ...)."""
    return None if value is None else value / divisor
