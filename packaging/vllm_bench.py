"""Launch vLLM with two (or more) speculative methods on a GPU machine and bench them side by side.

For a lent GPU machine with vLLM installed (this project's own machines have neither). Each
method gets its own vLLM server, started with the command ``specdeck launch`` would print (the
flag generation read from ``vllm serve --help``), all at once with a share of the GPU memory, so
the bench can interleave them prompt by prompt as the local bench does; then
``backends.remote.bench`` runs Spec-Bench against them and the table is written.

    python packaging/vllm_bench.py --model Qwen/Qwen2.5-1.5B-Instruct --methods ar,pld \\
        --per-category 10 --out vllm_bench.md
    python packaging/vllm_bench.py --model meta-llama/Llama-3.1-8B-Instruct --methods ar,eagle3 \\
        --draft yuhuili/EAGLE3-LLaMA3.1-Instruct-8B

Exit codes: 0 done, 2 no GPU or no vLLM here (nothing started), 1 a server did not come up.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from backends.remote.bench import ServerRow, run_server_bench  # noqa: E402
from backends.remote.client import ServerConfig  # noqa: E402
from backends.remote.launch import VllmLaunch, vllm_generation, vllm_plan  # noqa: E402


def _gpu_present() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _wait_ready(url: str, key: str, process: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5).is_success:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(2)
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the target (path or Hub id), 1B-8B for one GPU")
    ap.add_argument("--methods", default="ar,pld", help="SpecDeck names: ar, pld, draft, eagle2, eagle3, medusa, mtp, suffix")
    ap.add_argument("--draft", default=None, help="the draft model or head the methods that need one load")
    ap.add_argument("--tokens", type=int, default=5, help="draft tokens per step")
    ap.add_argument("--per-category", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=8100, help="the first server's port (the others follow)")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=Path("vllm_bench.md"))
    args = ap.parse_args()
    vllm = shutil.which("vllm")
    if vllm is None or not _gpu_present():
        print("vllm_bench: needs an NVIDIA GPU (nvidia-smi) and vLLM (`pip install vllm`); nothing started", file=sys.stderr)
        return 2
    help_text = subprocess.run([vllm, "serve", "--help"], capture_output=True, text=True, timeout=300).stdout
    generation = vllm_generation(help_text=help_text)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    share = round(0.85 / len(methods), 2)  # every server holds its share of the GPU at once
    key = secrets.token_hex(16)
    env = {**os.environ, "VLLM_API_KEY": key}
    servers: list[tuple[str, subprocess.Popen, str]] = []
    try:
        for i, method in enumerate(methods):
            port = args.port + i
            plan = vllm_plan(VllmLaunch(args.model, method, draft=args.draft, num_tokens=args.tokens, port=port,
                                        extra=("--gpu-memory-utilization", str(share), "--seed", "0")),
                             generation=generation)
            print(f"{method}: {' '.join(plan.server)}", file=sys.stderr)
            log = open(f"vllm_{method}.log", "w")  # noqa: SIM115 - open while the server runs
            servers.append((method, subprocess.Popen(list(plan.server), env=env, stdout=log, stderr=subprocess.STDOUT),
                            f"http://127.0.0.1:{port}"))
            if not _wait_ready(servers[-1][2], key, servers[-1][1], args.startup_timeout):
                print(f"vllm_bench: the {method} server did not come up; see vllm_{method}.log", file=sys.stderr)
                return 1
        rows = [ServerRow(method, ServerConfig(url, api_key=key, stall_timeout=600)) for method, _, url in servers]
        table = io.StringIO()
        result = run_server_bench(rows, per_category=args.per_category, max_new_tokens=args.max_new_tokens, out=table)
        header = f"vLLM ({generation} flags) on {args.model}, {args.per_category} Spec-Bench prompts per category\n\n"
        args.out.write_text(header + table.getvalue() + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
        print(header + table.getvalue())
        return 0
    finally:
        for _, process, _ in servers:
            process.terminate()
        for _, process, _ in servers:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


if __name__ == "__main__":
    sys.exit(main())
