"""Real servers for the remote-backend tests: llama-cpp-python's own OpenAI-compatible server
started on the bundled model (``specdeck serve``), and a fault-injecting proxy in front of it.

The proxy forwards every request to the real server and, when told, fails the way servers and
networks fail: drops the connection after some streamed lines, answers 500 or 429 (with a
``Retry-After``), or stalls mid-stream."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "test-key-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_server(tmp: Path, *, draft: str | None = None, model: str = "smollm2-135m-q4_1",
                 tls: tuple[Path, Path, Path] | None = None) -> Server:
    """``specdeck serve`` on 127.0.0.1 with the API key in its environment, ready when it lists
    its models; with ``tls`` = (CA certificate, server key, server certificate) it speaks HTTPS."""
    port = free_port()
    args = [sys.executable, "-m", "backends.remote.serve", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", "2048", "--n_threads", "1", "--verbose", "false"]
    if draft:
        args += ["--draft_model", draft, "--draft_model_num_pred_tokens", "8"]
    if tls is not None:
        args += ["--ssl_keyfile", str(tls[1]), "--ssl_certfile", str(tls[2])]
    log = tmp / f"server-{port}.log"
    env = {**os.environ, "API_KEY": API_KEY}
    with log.open("w") as out:
        process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}): {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=2,
                         verify=ssl.create_default_context(cafile=str(tls[0])) if tls else True).is_success:
                return Server(url, process, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    process.kill()
    raise RuntimeError(f"the server did not come up in 180 s: {log.read_text()[-2000:]}")


@dataclass
class Faults:
    """What the proxy does to the next requests (consumed in order; empty: pass through). A fault
    applies to the chat endpoint unless it names another ``path``."""

    plan: list[dict] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)  # request paths, in order
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next(self, path: str) -> dict:
        with self.lock:
            self.seen.append(path)
            if self.plan and path.endswith(self.plan[0].get("path", "/chat/completions")):
                return self.plan.pop(0)
            return {}


class Proxy:
    """A threaded HTTP proxy to ``upstream`` that injects ``faults``."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.faults = Faults()
        self.metrics_text: str | None = None  # served at /metrics when set (a server exporting GPU figures)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                proxy.handle(self, "GET")

            def do_POST(self) -> None:
                proxy.handle(self, "POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        if h.path == "/metrics" and self.metrics_text is not None:
            fault = {"status": 200, "body": self.metrics_text, "type": "text/plain; version=0.0.4"}
        else:
            fault = self.faults.next(h.path)
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        if "status" in fault:
            payload = fault.get("body", '{"error": {"message": "injected failure"}}').encode()
            h.send_response(fault["status"])
            for key, value in fault.get("headers", {}).items():
                h.send_header(key, value)
            h.send_header("Content-Type", fault.get("type", "application/json"))
            h.send_header("Content-Length", str(len(payload)))
            h.end_headers()
            h.wfile.write(payload)
            return
        headers = {k: v for k, v in h.headers.items() if k.lower() in ("authorization", "content-type")}
        with httpx.stream(method, self.upstream + h.path, content=body, headers=headers, timeout=120) as r:
            h.send_response(r.status_code)
            h.send_header("Content-Type", r.headers.get("content-type", "application/json"))
            h.send_header("Connection", "close")
            h.end_headers()
            for count, line in enumerate(r.iter_lines()):
                if "drop_after" in fault and count >= fault["drop_after"]:
                    h.connection.shutdown(socket.SHUT_RDWR)  # the network goes away mid-answer
                    return
                if "stall_after" in fault and count >= fault["stall_after"]:
                    time.sleep(fault["stall_for"])
                    return
                h.wfile.write((line + "\n").encode())
                h.wfile.flush()
        h.close_connection = True


def tls_files(tmp: Path) -> tuple[Path, Path, Path]:
    """A throwaway certificate authority and a certificate for 127.0.0.1 signed by it (trustme)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    paths = (tmp / "ca.pem", tmp / "server.key", tmp / "server.pem")
    ca.cert_pem.write_to_path(str(paths[0]))
    cert.private_key_pem.write_to_path(str(paths[1]))
    cert.cert_chain_pems[0].write_to_path(str(paths[2]))
    return paths


def dcgm_text(gpus: dict[int, float]) -> str:
    """What NVIDIA's dcgm-exporter serves for GPUs drawing ``gpus[i]`` watts, written by
    prometheus_client's own exposition code."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry()
    labels = ["gpu", "UUID", "device", "modelName", "Hostname"]
    power = Gauge("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", labels, registry=registry)
    temp = Gauge("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", labels, registry=registry)
    used = Gauge("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", labels, registry=registry)
    for i, watts in gpus.items():
        names = (str(i), f"GPU-{i:08d}", f"nvidia{i}", "NVIDIA H200", "gpu-box")
        power.labels(*names).set(watts)
        temp.labels(*names).set(55 + i)
        used.labels(*names).set(40960)
    return generate_latest(registry).decode()
