"""The server's GPUs on the live charts: a telemetry source reading NVIDIA's dcgm-exporter.

A serving engine does not publish its GPUs' power or temperature itself (vLLM's ``/metrics``
has none); GPU servers usually run dcgm-exporter beside it (port 9400). When connecting finds
one, the window's sampler reads this source instead of the local GPUs, so the power,
temperature and VRAM charts (and energy per token) are the server's.
"""

from __future__ import annotations

import httpx

from backends.hardware.types import GpuSample
from backends.remote.client import tls_verify
from backends.remote.metrics import parse_dcgm

DCGM_PORT = 9400


def find_gpu_metrics(base: str, own_metrics: str, *, verify: bool | str = True) -> str:
    """The address of the server's GPU metrics: its own ``/metrics`` when they hold DCGM
    figures, else a dcgm-exporter on the same host (asked without the API key, which belongs to
    the serving engine); "" when neither has them."""
    if "DCGM_FI_DEV_" in own_metrics:
        return f"{base}/metrics"
    host = base.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
    with httpx.Client(timeout=2.0, verify=tls_verify(verify)) as plain:
        for scheme in dict.fromkeys((base.split("://", 1)[0], "http")):
            url = f"{scheme}://{host}:{DCGM_PORT}/metrics"
            try:
                response = plain.get(url)
            except httpx.HTTPError:
                continue
            if response.is_success and "DCGM_FI_DEV_" in response.text:
                return url
    return ""


class ServerGpus:
    """A ``GpuSource`` for ``backends.hardware.telemetry.Sampler``: the server's GPUs."""

    def __init__(self, url: str, *, verify: bool | str = True) -> None:
        self.url = url
        self.http = httpx.Client(timeout=1.5, verify=tls_verify(verify))

    def read_all(self) -> tuple[tuple[GpuSample, ...], str | None]:
        try:
            response = self.http.get(self.url)
            response.raise_for_status()
            cards = parse_dcgm(response.text)
        except (httpx.HTTPError, ValueError) as exc:
            return (), f"the server's GPU metrics ({self.url}) stopped answering: {type(exc).__name__}"
        return cards, None if cards else f"{self.url} reports no GPU"

    def close(self) -> None:
        self.http.close()
