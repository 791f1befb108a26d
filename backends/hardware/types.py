"""What SpecDeck knows about the machine: frozen records, JSON-ready.

Every field that a probe could not read is ``None`` ("unknown"), never a guess: a missing driver,
an unreadable sysfs file or an NVML call the card does not support is a normal outcome on a home
PC, and the report must still come out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class CpuInfo:
    name: str
    vendor: str | None
    arch: str  # platform.machine(): x86_64, AMD64, arm64, aarch64
    cores: int | None  # physical
    threads: int | None  # logical
    flags: tuple[str, ...]  # the instruction sets llama.cpp has kernels for: avx2, avx512f, ...
    caches: dict[str, int] = field(default_factory=dict)  # "L1d", "L2", "L3" -> bytes (per core/cluster as reported)
    max_mhz: float | None = None


@dataclass(frozen=True)
class RamInfo:
    total_bytes: int
    available_bytes: int


@dataclass(frozen=True)
class GpuInfo:
    """One graphics card. Live fields (power, temperature, ...) are a snapshot at detection time."""

    index: int
    name: str
    vendor: str  # "nvidia" | "amd" | "intel" | "other"
    source: str  # where this came from: "nvml", "sysfs", "windows-registry", "dxgi"
    vram_total_bytes: int | None
    vram_free_bytes: int | None = None
    vram_used_bytes: int | None = None
    driver_version: str | None = None
    cuda_version: str | None = None  # the highest CUDA version the driver supports, e.g. "12.8"
    compute_capability: str | None = None  # e.g. "8.9"
    power_w: float | None = None
    power_limit_w: float | None = None
    temperature_c: float | None = None
    utilization_pct: float | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    mem_bus_width_bits: int | None = None
    energy_mj: int | None = None  # total energy counter since driver load (NVML, Volta and newer)
    pci_bus_id: str | None = None

    @property
    def bandwidth_bytes_s(self) -> float | None:
        """Theoretical memory bandwidth: bus width x memory clock x 2 (double data rate).

        NVML reports GDDR6X and HBM clocks so that this product gives the datasheet figure
        (RTX 4090: 384 bit x 10501 MHz x 2 = 1008 GB/s; H100 SXM: 5120 bit x 2619 MHz x 2).
        """
        if not self.mem_bus_width_bits or not self.mem_clock_mhz:
            return None
        return self.mem_bus_width_bits / 8 * self.mem_clock_mhz * 1e6 * 2


@dataclass(frozen=True)
class GpuSample:
    """One live telemetry reading of one GPU."""

    index: int
    vram_used_bytes: int | None
    power_w: float | None
    temperature_c: float | None
    utilization_pct: float | None
    energy_mj: int | None = None  # NVML's total energy counter, when the card has one


@dataclass(frozen=True)
class LlamaBuild:
    """The installed llama-cpp-python and the devices its llama.cpp build can put layers on."""

    version: str
    backends: tuple[str, ...]  # "CPU", "CUDA", "Vulkan", "Metal", ...
    gpu_offload: bool
    system_info: str
    cpu_variant: str | None = None  # the CPU module that runs ("zen4"); None: a build without variants
    cpu_variant_why: str = ""  # why that one: the probe's verdict in words
    gpu_backend: str | None = None  # the GPU module that runs ("cuda", "vulkan"); None: CPU only
    gpu_backend_why: str = ""  # which devices it drives, or why no GPU module is used
    small_batch: str | None = None  # SpecDeck's small-batch kernel: "on", "off", None (not in this build)

    @property
    def offload_targets(self) -> tuple[str, ...]:
        return tuple(b for b in self.backends if b not in ("CPU", "BLAS", "RPC"))


@dataclass(frozen=True)
class HardwareReport:
    os: str
    cpu: CpuInfo
    ram: RamInfo
    gpus: tuple[GpuInfo, ...]
    llama_cpp: LlamaBuild | None
    notes: tuple[str, ...] = ()  # "no NVIDIA GPU (NVML: driver library not found)", ...

    def to_json(self) -> dict:
        out = asdict(self)
        for gpu, raw in zip(self.gpus, out["gpus"]):
            raw["bandwidth_bytes_s"] = gpu.bandwidth_bytes_s
        if self.llama_cpp is not None:
            out["llama_cpp"]["offload_targets"] = list(self.llama_cpp.offload_targets)
        return out
