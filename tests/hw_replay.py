"""Recorded machines for tests: a stand-in for the pynvml module that answers from recorded driver
data, and a CPU-only machine built from the recorded /proc and /sys trees (tests/data/hw)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

from backends.hardware.cpu import detect_cpu
from backends.hardware.types import HardwareReport, LlamaBuild, RamInfo

HW = Path(__file__).parent / "data" / "hw"


class NvmlReplay:
    """Stands in for the pynvml module: its function names and NVML_* constants, answers from a recording.

    A recorded answer is a plain value, ``{"bytes": text}`` (what older bindings return),
    ``{"error": "NVML_ERROR_..."}`` (raised as a real pynvml.NVMLError), ``{"sequence": [...]}``
    (one answer per call, the last one repeating) or a struct as a dict of fields. Calls that take
    a constant (clock type, sensor) are keyed by the constant's name. A function the recording
    never mentions is missing here too, like a call an old binding does not have.
    """

    def __init__(self, pynvml, recording: dict):
        for name in dir(pynvml):
            if name.startswith("NVML_"):
                setattr(self, name, getattr(pynvml, name))
        self.NVMLError = pynvml.NVMLError
        self._pynvml = pynvml
        self._system = {k: v for k, v in recording.items() if k != "devices"}
        self._devices = recording.get("devices", [])
        self._calls: Counter = Counter()
        self.shutdowns = 0

    def nvmlInit(self):
        self._answer(("nvmlInit",), self._system.get("nvmlInit"))

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self._devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._answer((index, "handle"), self._devices[index].get("nvmlDeviceGetHandleByIndex"))
        return index

    def __getattr__(self, name):
        if name in self._system:
            return lambda: self._answer((name,), self._system[name])
        if any(name in device for device in self._devices):
            return partial(self._device_call, name)
        raise AttributeError(name)

    def _device_call(self, name, handle, *args):
        recorded = self._devices[handle].get(name, {"error": "NVML_ERROR_NOT_SUPPORTED"})
        if args:
            recorded = {getattr(self._pynvml, constant): v for constant, v in recorded.items()}[args[0]]
        return self._answer((handle, name, args), recorded)

    def _answer(self, key, recorded):
        call = self._calls[key]
        self._calls[key] += 1
        return self._decode(recorded, call)

    def _decode(self, value, call):
        if isinstance(value, list):
            return tuple(value)
        if not isinstance(value, dict):
            return value
        if "sequence" in value:
            return self._decode(value["sequence"][min(call, len(value["sequence"]) - 1)], call)
        if "error" in value:
            raise self._pynvml.NVMLError(getattr(self._pynvml, value["error"]))
        if "bytes" in value:
            return value["bytes"].encode()
        return SimpleNamespace(**{k: self._decode(v, call) for k, v in value.items()})


def load_replay(name: str, edit=None) -> NvmlReplay:
    """A fresh NvmlReplay of ``tests/data/hw/<name>``, the recording optionally edited first."""
    import pynvml

    recording = json.loads((HW / name).read_text())
    if edit:
        edit(recording)
    return NvmlReplay(pynvml, recording)


GiB = 1024**3


def recorded_cpu_machine() -> HardwareReport:
    """The development VM as a CPU-only machine, the same on every PC that runs the tests.

    The CPU is the recorded AMD EPYC Zen 4 (``proc_epyc_zen4``, ``sys_epyc_zen4``; 2 vCPUs); the
    RAM (16 GiB, 12 GiB available) and the CPU-only llama.cpp build are chosen for the tests, not
    recorded. Tests that mean "a machine without a GPU" use this instead of the machine they run on.
    """
    cpu = detect_cpu(proc_root=HW / "proc_epyc_zen4", sys_root=HW / "sys_epyc_zen4")
    build = LlamaBuild(version="0.3.36", backends=("CPU",), gpu_offload=False,
                       system_info="CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 1 | "
                                   "AVX512_VNNI = 1 | AVX512_BF16 = 1 | OPENMP = 1 | REPACK = 1 |")
    return HardwareReport(os="Linux", cpu=replace(cpu, arch="x86_64", cores=2, threads=2),
                          ram=RamInfo(total_bytes=16 * GiB, available_bytes=12 * GiB), gpus=(), llama_cpp=build,
                          notes=("no NVIDIA GPU (NVML: driver library not found)",))
