"""Which llama.cpp the installed llama-cpp-python carries, and what it can offload layers to.

llama.cpp prints one ``NAME : FEATURE = 1 | ...`` group per compiled-in backend in its system
info (``CPU : SSE3 = 1 | ...``, ``CUDA : ARCHS = 890 | ...``), which is the only place
llama-cpp-python exposes the list; ``llama_supports_gpu_offload`` says whether any of them is a
GPU. The CPU variant (portable builds carry one module per instruction-set level) is the one
``llama_runtime`` probed and loaded; when none survives, the build is reported as unusable. A GPU
module (``gpu_runtime``) prints no group of its own, so the one that runs is added by name.
"""

from __future__ import annotations

import re

from backends.core.errors import BackendError
from backends.hardware.types import LlamaBuild
from backends.models.gpu_runtime import LABELS

_GROUP = re.compile(r"(?:^|\|)\s*([A-Za-z][A-Za-z0-9_-]*) : ")


def parse_backends(system_info: str) -> tuple[str, ...]:
    """'CPU : AVX2 = 1 | CUDA : ARCHS = 890 | ' -> ('CPU', 'CUDA')."""
    seen: list[str] = []
    for name in _GROUP.findall(system_info):
        if name not in seen:
            seen.append(name)
    return tuple(seen)


def detect_llama_build() -> LlamaBuild | None:
    """None when llama-cpp-python cannot be imported (the report then says so)."""
    try:
        from backends.models.llama_lib import (cpu_runtime, gpu_runtime, library_version, llama, small_batch_kernel,
                                               system_info)

        runtime, gpu_rt = cpu_runtime(), gpu_runtime()
        small_batch = small_batch_kernel()
        info = system_info()
        gpu = bool(llama().llama_supports_gpu_offload())
    except (ImportError, OSError, AttributeError):
        return None
    except BackendError as exc:  # no CPU code of this build survives the probe
        return LlamaBuild(version="unusable here", backends=(), gpu_offload=False, system_info="",
                          cpu_variant=None, cpu_variant_why=str(exc))
    backends = parse_backends(info)
    if gpu_rt is not None and gpu_rt.backend is not None and LABELS[gpu_rt.backend] not in backends:
        backends += (LABELS[gpu_rt.backend],)  # a loaded GPU module adds no features to the system info
    return LlamaBuild(version=library_version(), backends=backends or ("CPU",), gpu_offload=gpu, system_info=info.strip(),
                      cpu_variant=runtime.variant if runtime else None, cpu_variant_why=runtime.why if runtime else "",
                      gpu_backend=gpu_rt.backend if gpu_rt else None, gpu_backend_why=gpu_rt.why if gpu_rt else "",
                      small_batch=small_batch)
