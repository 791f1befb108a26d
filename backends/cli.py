"""The ``specdeck`` command line: chat, models, bench, hw, fit, recommend.

    specdeck chat                          # chat with the bundled model (prompt lookup on)
    specdeck chat --model smollm2-135m-f16 --method draft --draft-model smollm2-135m-q4_1
    specdeck models list
    specdeck models search smollm2 && specdeck models download bartowski/SmolLM2-360M-Instruct-GGUF FILE.gguf
    specdeck bench --model smollm2-135m-f16 --methods ar,pld --per-category 2
    specdeck hw --json
    specdeck fit gemma3-270m-q4_k_m --ctx 8192
    specdeck recommend smollm2-135m-f16 --task summarize
    specdeck train medusa --model smollm2-135m-f16 --minutes 30
    specdeck train eagle --model smollm2-135m-f16 --minutes 30
"""

from __future__ import annotations

import os

# numpy's OpenBLAS threads spin on the same cores llama.cpp computes on; SpecDeck does no large
# matrix work in numpy, so one BLAS thread is plenty. Must be set before numpy is imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from backends.addons import activate  # noqa: E402
from backends.core.errors import SpecDeckError  # noqa: E402


def _add_session_args(p: argparse.ArgumentParser, *, default_model: str) -> None:
    p.add_argument("--model", default=default_model, help="known model id or path to a .gguf file")
    p.add_argument("--draft-model", default=None, help="draft model (id or path) for the draft method")
    p.add_argument("--n-ctx", type=int, default=4096, help="context length in tokens")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--n-gpu-layers", type=int, default=-1,
                   help="layers to put on the GPU (default -1: what `specdeck fit` places on the GPU module that runs; "
                        "0: CPU only)")
    p.add_argument("--flash-attn", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--head", action="append", default=[], metavar="FILE",
                   help="a trained head (.json from `specdeck train`); default: those found for the model")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="the PyTorch backend's weight type (auto: bfloat16 on a GPU; on a CPU the one whose "
                        "one-row product is fastest there, timed at load)")


def _add_sampling_args(p: argparse.ArgumentParser, *, temperature: float) -> None:
    p.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _parse_setting(text: str) -> tuple[str, str, object]:
    """``pld.max_draft=12`` -> ("pld", "max_draft", 12)."""
    try:
        key, raw = text.split("=", 1)
        method, name = key.split(".", 1)
    except ValueError:
        raise SpecDeckError(f"--set takes METHOD.NAME=VALUE, got {text!r}") from None
    try:
        value: object = json.loads(raw)
    except ValueError:
        value = raw
    return method, name, value


def _method_settings(items: list[str]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for item in items:
        method, name, value = _parse_setting(item)
        out.setdefault(method, {})[name] = value
    return out


def build_parser() -> argparse.ArgumentParser:
    from backends.drafters import REGISTRY
    from backends.hardware.commands import add_commands as add_hardware_commands
    from backends.models.catalog import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="specdeck", description="Lossless speculative decoding for local LLMs.")
    parser.add_argument("--verbose", action="store_true", help="show llama.cpp's log")
    sub = parser.add_subparsers(dest="command", required=True)

    chat = sub.add_parser("chat", help="interactive terminal chat with live stats")
    _add_session_args(chat, default_model=DEFAULT_MODEL)
    _add_sampling_args(chat, temperature=0.0)
    chat.add_argument("--method", default="pld", choices=sorted(REGISTRY))
    chat.add_argument("--backend", default="llamacpp", choices=("llamacpp", "torch"),
                      help="what runs the model: llama.cpp, or SpecDeck's PyTorch model (needs torch)")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--max-new-tokens", type=int, default=512)
    chat.add_argument("--set", action="append", default=[], metavar="METHOD.NAME=VALUE", help="a method setting")
    _add_server_args(chat, many=False)

    models = sub.add_parser("models", help="list, locate and derive models")
    msub = models.add_subparsers(dest="models_command")  # none: list, what "specdeck models" alone should say
    models.set_defaults(models_command="list", json=False)
    mlist = msub.add_parser("list", help="known model ids, paths, sizes, presence")
    mlist.add_argument("--json", action="store_true")
    mpath = msub.add_parser("path", help="print a model's path (deriving it first if needed)")
    mpath.add_argument("id")
    minfo = msub.add_parser("info", help="GGUF metadata of a model, read without loading it")
    minfo.add_argument("id", help="known id or path to a .gguf file")
    minfo.add_argument("--json", action="store_true")
    mderive = msub.add_parser("derive", help="make derived variants (all by default)")
    mderive.add_argument("ids", nargs="*")
    mderive.add_argument("--force", action="store_true", help="make them again even if current")
    msearch = msub.add_parser("search", help="search the Hugging Face Hub (GGUF repositories by default)")
    msearch.add_argument("query")
    msearch.add_argument("--all", action="store_true", help="not only repositories with GGUF files")
    msearch.add_argument("--limit", type=int, default=20)
    mfiles = msub.add_parser("files", help="the files of a Hugging Face repository, with sizes")
    mfiles.add_argument("repo")
    mdown = msub.add_parser("download", help="download files from the Hub into the library (resumable)")
    mdown.add_argument("repo")
    mdown.add_argument("files", nargs="+", help="file paths in the repository (a split GGUF's first part is enough)")
    mdown.add_argument("--out", type=Path, default=None, help="library folder (default: the app's)")
    mheads = msub.add_parser("heads", help="EAGLE-3 heads published on the Hub for a model, best fitting first")
    mheads.add_argument("model", help="known id or path to a .gguf file")
    mhead = msub.add_parser("get-head", help="download a published EAGLE-3 head for a model (its config is checked first)")
    mhead.add_argument("repo")
    mhead.add_argument("--model", required=True, help="known id or path to a .gguf file")
    for hub_cmd in (msearch, mfiles, mdown, mheads, mhead):
        hub_cmd.add_argument("--endpoint", default=None, help="another Hub address (default huggingface.co or HF_ENDPOINT)")

    bench = sub.add_parser("bench", help="benchmark methods side by side on Spec-Bench")
    _add_session_args(bench, default_model="smollm2-135m-f16")
    bench.add_argument("--methods", default="ar,pld,peer-llamacpp,peer-llamacpp-pld",
                       help=f"comma-separated: {', '.join(REGISTRY)}, peer-llamacpp, peer-llamacpp-pld; "
                            "torch:METHOD runs METHOD on the PyTorch backend in the same run; hf-ar, hf-pld, "
                            "hf-assisted are transformers' own generate (plain, prompt lookup, --draft-model assisting)")
    bench.add_argument("--backend", default="llamacpp", choices=("llamacpp", "torch"),
                       help="what runs the methods named without a backend, ar among them (torch for a Hugging Face folder)")
    bench.add_argument("--prompts", type=Path, default=None, help="Spec-Bench JSONL (default: the questions shipped in assets/spec_bench)")
    bench.add_argument("--per-category", type=int, default=10)
    bench.add_argument("--categories", default=None, help="comma-separated (mt_bench, translation, ...)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument("--set", action="append", default=[], metavar="METHOD.NAME=VALUE", help="a method setting")
    bench.add_argument("--json", type=Path, default=None, help="write every record and the summary here")
    bench.add_argument("--csv", type=Path, default=None, help="write one row per (method, prompt) here")
    bench.add_argument("--datastore", default=None, help="REST datastore file for rest (and specinfer with rest)")
    _add_server_args(bench, many=True)
    serve = sub.add_parser("serve", help="llama-cpp-python's OpenAI-compatible server on this PC's llama.cpp code",
                           add_help=False)
    serve.add_argument("server_args", nargs=argparse.REMAINDER, help="its own arguments (--model ID_OR_PATH --port N ...)")
    launch = sub.add_parser("launch", help="the command that starts vLLM or llama-server with a speculative method")
    launch.add_argument("engine", choices=("vllm", "llama-server"))
    launch.add_argument("--model", required=True, help="the target (path or Hub id)")
    launch.add_argument("--method", default="ar", help="SpecDeck's name: ar, pld, draft, eagle2, eagle3, medusa, mtp, suffix")
    launch.add_argument("--draft", default=None, help="draft model or head (path or Hub id)")
    launch.add_argument("--tokens", type=int, default=None, help="draft tokens per step (vLLM 5, llama-server 8)")
    launch.add_argument("--port", type=int, default=None)
    launch.add_argument("--host", default="127.0.0.1")
    launch.add_argument("--tp", type=int, default=1, help="vLLM: tensor-parallel GPUs")
    launch.add_argument("--pp", type=int, default=1, help="vLLM: pipeline-parallel stages")
    launch.add_argument("--nodes", type=int, default=1, help="vLLM: machines (more than one: a Ray cluster)")
    launch.add_argument("--head", default="", help="vLLM multi-node: the head node's address")
    launch.add_argument("--vllm-version", default=None, help="vLLM's version when `vllm` is not on this machine")
    launch.add_argument("--binary", default="llama-server", help="llama-server's path (its --help picks the flags)")
    store = sub.add_parser("datastore", help="REST datastores: your own texts indexed for retrieval drafting")
    ssub = store.add_subparsers(dest="datastore_command", required=True)
    sbuild = ssub.add_parser("build", help="tokenize a folder of texts (.txt/.md/.py ..., .jsonl) and index it")
    sbuild.add_argument("--model", default=DEFAULT_MODEL, help="the model whose tokenizer the datastore uses")
    sbuild.add_argument("--source", type=Path, required=True, action="append", help="a folder or file (repeatable)")
    sbuild.add_argument("--out", type=Path, required=True, help="the datastore file to write")
    sinfo = ssub.add_parser("info", help="what a datastore holds and which tokenizer it was built with")
    sinfo.add_argument("file", type=Path)
    sans = ssub.add_parser("answers", help="the model's own answers to held-out Spec-Bench prompts, as JSONL "
                                           "(a datastore source that a bench does not evaluate)")
    sans.add_argument("--model", default="smollm2-135m-f16")
    sans.add_argument("--per-category", type=int, default=34)
    sans.add_argument("--exclude-per-category", type=int, default=10,
                      help="leave out the prompts `specdeck bench --per-category N` evaluates")
    sans.add_argument("--max-new-tokens", type=int, default=256)
    sans.add_argument("--prompts", type=Path, default=None)
    sans.add_argument("--out", type=Path, required=True)
    train = sub.add_parser("train", help="train a draft head for a model, on this PC, from its own answers")
    from backends.heads.files import HEAD_KINDS
    from backends.heads.training import DEVICES, PRECISIONS
    from backends.train import FOLLOW_UP_TURNS

    train.add_argument("kind", choices=HEAD_KINDS)
    train.add_argument("--model", default=DEFAULT_MODEL, help="known model id or path to a .gguf file")
    train.add_argument("--data", default="spec-bench",
                       help="spec-bench (questions a bench does not evaluate), chats (what you asked in the "
                            "window's saved conversations), self (questions the model writes itself; --prompts "
                            "says how many) or a JSONL file of prompts; several joined by commas train on them together")
    train.add_argument("--minutes", type=float, default=30.0, help="the whole time budget, recording included")
    train.add_argument("--prompts", type=int, default=None, help="record at most this many conversations (of each --data source)")
    train.add_argument("--steps", type=int, default=None, help="training steps (default: what the time allows)")
    train.add_argument("--max-new-tokens", type=int, default=256, help="longest recorded answer")
    train.add_argument("--follow-ups", type=int, default=FOLLOW_UP_TURNS,
                       help="turns asked after each conversation's own, as a chat goes on (more to learn from "
                            f"few prompts; default {FOLLOW_UP_TURNS})")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--precision", choices=PRECISIONS, default="auto",
                       help="the training products' type (auto: bfloat16 autocast where this CPU runs it faster, "
                            "timed at start; a head says which it was trained in)")
    train.add_argument("--device", choices=DEVICES, default="auto",
                       help="where the head trains (auto: a CUDA GPU torch sees, else the CPU; recording runs on "
                            "the model's own backend either way)")
    train.add_argument("--threads", type=int, default=None)
    train.add_argument("--out", type=Path, default=None, help="where to write the head (default: the user's heads)")
    train.add_argument("--progress", choices=("text", "json"), default="text",
                       help="json: one JSON line per progress event on stdout (for other programs)")
    add_hardware_commands(sub)
    return parser


def cmd_models(args: argparse.Namespace) -> int:
    from backends.models.catalog import CATALOG, ensure, list_models, resolve_model

    if args.models_command == "list":
        rows = list_models()
        if args.json:
            print(json.dumps(rows, indent=1))
            return 0
        for r in rows:
            size = f"{r['size_bytes'] / 2**20:7.1f} MiB" if r["size_bytes"] else "      -    "
            state = "present" if r["present"] else "not yet made (specdeck models derive)"
            print(f"{r['id']:22} {size}  {state:10}  {r['path']}\n{'':22} {r['description']}")
        return 0
    if args.models_command == "path":
        print(resolve_model(args.id))
        return 0
    if args.models_command == "info":
        return _models_info(resolve_model(args.id), as_json=args.json)
    if args.models_command in ("search", "files", "download"):
        return _models_hub(args)
    if args.models_command in ("heads", "get-head"):
        return _hub_heads(args)
    ids = args.ids or [m for m, e in CATALOG.items() if e.made_here]
    for model_id in ids:
        path = ensure(model_id, force=args.force, progress=lambda msg: print(msg, file=sys.stderr))
        print(f"{model_id}: {path}")
    return 0


def _models_info(path: Path, *, as_json: bool) -> int:
    from dataclasses import asdict

    from backends.models.gguf_info import read_gguf_info

    info = read_gguf_info(path)
    _check_llama_reads(path)
    if as_json:
        data = asdict(info)
        data["vocab"] = {k: v for k, v in data["vocab"].items() if k != "tokens"}
        print(json.dumps(data, indent=1))
        return 0
    v = info.vocab
    print(f"{info.name} ({info.architecture}, {info.file_type}) {path}\n"
          f"  parameters {info.n_params / 1e6:.1f} M, weights {info.weights_bytes / 2**20:.1f} MiB in {len(info.tensors)} tensors\n"
          f"  layers {info.n_layer}, embedding {info.n_embd}, heads {info.n_head} (KV {info.n_head_kv}), "
          f"trained context {info.n_ctx_train}" + (f", sliding window {info.sliding_window}" if info.sliding_window else "") + "\n"
          f"  vocabulary {v.kind} {v.n_vocab} tokens, BOS {v.bos}, EOS {v.eos}, add BOS {v.add_bos}\n"
          f"  chat template: {'yes' if info.chat_template else 'none (plain transcript)'}")
    return 0


def _check_llama_reads(path: Path) -> None:
    """llama.cpp's own verdict on a file whose header reads: an architecture it implements and a
    vocabulary it loads (a vocab-only load, no weights). Its log is held back meanwhile unless
    --verbose: a refusal comes back once, as the error's one line."""
    from backends.llamacpp.model import LlamaModel

    log = logging.getLogger("specdeck.llama")
    level = log.level
    if log.getEffectiveLevel() >= logging.ERROR:
        log.setLevel(logging.CRITICAL)
    try:
        LlamaModel(path, vocab_only=True).close()
    finally:
        log.setLevel(level)


def _hub_heads(args: argparse.Namespace) -> int:
    from backends.heads import from_hub
    from backends.models.catalog import resolve_model
    from backends.models.hub import DownloadProgress

    model = resolve_model(args.model)
    if args.models_command == "heads":
        for m in from_hub.search_heads(model, endpoint=args.endpoint):
            print(f"{m.id:60} {m.downloads:>10,} downloads")
        return 0
    state = DownloadProgress(files=1, total_bytes=0)
    from_hub.install_head(args.repo, model, state, endpoint=args.endpoint)
    if state.result is None:
        print(f"specdeck: {state.error or 'cancelled'}", file=sys.stderr)
        return 1
    print(state.result)
    return 0


def _models_hub(args: argparse.Namespace) -> int:
    from backends.models import hub
    from backends.models.paths import library_dir

    if args.models_command == "search":
        for m in hub.search_models(args.query, gguf_only=not args.all, limit=args.limit, endpoint=args.endpoint):
            print(f"{m.id:60} {m.downloads:>10,} downloads")
        return 0
    files = hub.list_files(args.repo, endpoint=args.endpoint)
    if args.models_command == "files":
        for f in files:
            print(f"{f.size / 2**20:10,.1f} MiB  {f.path}" + ("  (pickle: refused)" if f.kind == "pickle" else ""))
        return 0
    root = args.out or library_dir()

    def show(stage: str, done: int, total: int | None) -> None:
        print(f"\r  {'checking' if stage == 'verify' else 'downloading'} {done / 2**20:,.1f}"
              f" of {(total or 0) / 2**20:,.1f} MiB   ", end="", file=sys.stderr, flush=True)

    for f in hub.expand_selection(files, args.files):
        print(f"{args.repo}/{f.path}", file=sys.stderr)
        try:
            path = hub.download_file(args.repo, f.path, root, endpoint=args.endpoint, progress=show)
        except KeyboardInterrupt:
            print("\n  interrupted: the same command resumes the download", file=sys.stderr)
            raise
        print(file=sys.stderr)
        print(path)
    return 0


def _session_config(args: argparse.Namespace):
    from backends.factory import SessionConfig

    return SessionConfig(model=args.model, draft_model=args.draft_model, n_ctx=args.n_ctx, n_threads=args.threads,
                         n_gpu_layers=args.n_gpu_layers, flash_attn=args.flash_attn, heads=tuple(args.head),
                         backend=getattr(args, "backend", "llamacpp"), dtype=args.dtype)


def _add_server_args(p: argparse.ArgumentParser, *, many: bool) -> None:
    if many:
        p.add_argument("--server", action="append", default=[], metavar="[NAME=]URL",
                       help="bench OpenAI-compatible servers instead of local methods (the first is the baseline)")
    else:
        p.add_argument("--server", default=None, metavar="URL", help="chat with an OpenAI-compatible server (vLLM, llama-server)")
        p.add_argument("--served-model", default=None, help="which of the server's models (default: its first)")
    p.add_argument("--api", choices=("auto", "chat", "completions"), default="auto",
                   help="the endpoint asked: chat completions, plain completions (the conversation as a "
                        "'User: ... Assistant:' transcript, for base models), or auto: chat unless the "
                        "server has no chat template for the model")
    p.add_argument("--api-key-env", default="SPECDECK_API_KEY",
                   help="environment variable holding the server's API key (else the key saved for its address)")


def _server_key(args: argparse.Namespace, url: str) -> str | None:
    from backends.remote.keys import load_key

    return os.environ.get(args.api_key_env) or load_key(url)


def cmd_chat_server(args: argparse.Namespace) -> int:
    from backends.chat import ChatState, chat_loop
    from backends.core.types import GenerationSettings, SamplingSettings
    from backends.remote.client import ServerConfig
    from backends.remote.session import RemoteSession

    sampling = SamplingSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed)
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, sampling=sampling)
    config = ServerConfig(args.server, api_key=_server_key(args, args.server), model=args.served_model, api=args.api)
    with RemoteSession(config) as session:
        print(f"SpecDeck chat · {session.info.label} · Ctrl+C stops an answer, Ctrl+D quits", file=sys.stderr)
        chat_loop(session, ChatState(method="server", system=args.system), settings)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from backends.remote.serve import main as serve_main

    rest = list(args.server_args)
    return serve_main(rest[1:] if rest[:1] == ["--"] else rest)


def cmd_launch(args: argparse.Namespace) -> int:
    import shutil
    import subprocess

    from backends.remote import launch

    if args.engine == "vllm":
        found = shutil.which("vllm") if args.vllm_version is None else None
        help_text = subprocess.run([found, "serve", "--help"], capture_output=True, text=True, timeout=120).stdout if found else None
        generation = launch.vllm_generation(version=args.vllm_version, help_text=help_text)
        spec = launch.VllmLaunch(args.model, args.method, draft=args.draft, num_tokens=args.tokens or 5,
                                 host=args.host, port=args.port or 8000,
                                 parallel=launch.Parallel(args.tp, args.pp, args.nodes, args.head))
        plan = launch.vllm_plan(spec, generation=generation)
    else:
        binary = shutil.which(args.binary)
        if binary is None:
            raise SpecDeckError(f"{args.binary} not found; pass --binary PATH (its --help decides the flag spelling)")
        help_text = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60).stdout
        plan = launch.llama_server_plan(args.model, flags=launch.llama_server_flags(help_text), method=args.method,
                                        draft=args.draft, num_tokens=args.tokens or 8, host=args.host,
                                        port=args.port or 8080, binary=binary)
    print(plan.shell())
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    if args.server:
        return cmd_chat_server(args)
    from backends.chat import ChatState, chat_loop
    from backends.core.types import GenerationSettings, SamplingSettings
    from backends.factory import Session
    from backends.hardware.commands import named_as_given

    sampling = SamplingSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed)
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, sampling=sampling)
    print(f"loading {args.model} ...", file=sys.stderr)
    _note_cpu_fallback()
    with Session(_session_config(args)) as session:
        if not session.costs_known():
            print("checking what verification costs on this machine (measured once per model) ...", file=sys.stderr)
        session.drafter(args.method, sampling, **_method_settings(args.set).get(args.method, {}))  # fail early
        shown = named_as_given(args.model, session.model.path.name)  # not general.name: it can be a training run's
        print(f"SpecDeck chat · {shown} · method {args.method} · "
              f"context {session.target.n_ctx} · /help for commands, Ctrl+C stops an answer, Ctrl+D quits",
              file=sys.stderr)
        state = ChatState(method=args.method, system=args.system)
        chat_loop(session, state, settings)
    return 0


def _note_cpu_fallback() -> None:
    """Say once (when the probe just ran) that llama.cpp's best CPU code died here."""
    from backends.models.llama_lib import cpu_runtime

    runtime = cpu_runtime()  # the first time on a machine this probes the CPU variants (~5 s)
    if runtime is not None and not runtime.cached and runtime.fallback_note:
        print(f"note: {runtime.fallback_note}", file=sys.stderr)


def cmd_datastore(args: argparse.Namespace) -> int:
    from backends.models.datastore import Datastore, build_datastore, read_sources, source_texts

    if args.datastore_command == "answers":
        from backends.bench import BenchConfig, write_answers

        from backends.drafters import baseline_method

        config = BenchConfig(model=args.model, methods=(baseline_method(),), prompts=args.prompts, per_category=args.per_category,
                             max_new_tokens=args.max_new_tokens)
        count = write_answers(config, args.out, exclude_per_category=args.exclude_per_category)
        print(f"{args.out}: {count} answers", file=sys.stderr)
        return 0
    if args.datastore_command == "info":
        store = Datastore(args.file)
        meta = store.meta
        print(f"{args.file}: {store.n_tokens:,} tokens in {meta.get('documents')} documents, "
              f"{store.nbytes / 2**20:,.1f} MiB\n  tokenizer of {meta.get('model')} "
              f"({meta.get('vocab_kind')}, {meta.get('n_vocab')} tokens)")
        return 0
    from backends.llamacpp.model import LlamaModel
    from backends.models.catalog import resolve_model

    files = [f for source in args.source for f in source_texts(source)]
    with LlamaModel(resolve_model(args.model), vocab_only=True) as model:
        def show(done: int, total: int) -> None:
            print(f"\r  tokenizing: {done:,} documents from {total:,} files", end="", file=sys.stderr, flush=True)

        report = build_datastore(read_sources(files), args.out, tokenize=lambda t: model.tokenize(t, add_special=False, parse_special=False),
                                 vocab=model.vocab_info, model_name=model.name, progress=show, total=len(files))
    print(f"\n{report.path}: {report.tokens:,} tokens from {report.documents:,} documents, "
          f"{report.bytes / 2**20:,.1f} MiB", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from backends.bench import BenchConfig, run_bench, write_csv, write_json

    if args.server:
        return cmd_bench_servers(args)
    config = BenchConfig(
        model=args.model, methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
        draft_model=args.draft_model, prompts=args.prompts, per_category=args.per_category,
        categories=tuple(c.strip() for c in args.categories.split(",")) if args.categories else None,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, repeats=args.repeats,
        n_ctx=args.n_ctx, n_threads=args.threads, n_gpu_layers=args.n_gpu_layers, flash_attn=args.flash_attn,
        method_settings=_with_datastore(_method_settings(args.set), args.datastore), heads=tuple(args.head),
        dtype=args.dtype, backend=args.backend,
    )
    result = run_bench(config)
    if args.json:
        write_json(result, args.json)
    if args.csv:
        write_csv(result, args.csv)
    return 0


def cmd_bench_servers(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from backends.remote.bench import parse_servers, run_server_bench

    rows = parse_servers(args.server)
    rows = [type(row)(row.name, replace(row.config, api_key=_server_key(args, row.config.url), api=args.api))
            for row in rows]
    result = run_server_bench(rows, prompts_file=args.prompts, per_category=args.per_category,
                              categories=tuple(c.strip() for c in args.categories.split(",")) if args.categories else None,
                              max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from backends.train import TrainRequest, json_report, text_report, train

    train(TrainRequest(kind=args.kind, model=args.model, data=args.data, minutes=args.minutes, prompts=args.prompts,
                       steps=args.steps, max_new_tokens=args.max_new_tokens, seed=args.seed, out=args.out,
                       n_threads=args.threads, follow_ups=args.follow_ups,
                       precision=args.precision, device=args.device),
          report=json_report() if args.progress == "json" else text_report())
    return 0


def _with_datastore(settings: dict[str, dict], datastore: str | None) -> dict[str, dict]:
    """``--datastore FILE`` is the datastore setting of every method that has one."""
    from backends.drafters import REGISTRY

    if datastore:
        for name, spec in REGISTRY.items():
            if spec.datastore_field:
                settings.setdefault(name, {}).setdefault(spec.datastore_field, datastore)
    return settings


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # everything after it is the server's own (argparse would take its options)
        argv = ["serve", "--", *argv[1:]]
    args = build_parser().parse_args(argv)
    activate()  # torch installed as an add-on (backends/addons.py), for the commands that use it
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("specdeck.llama").setLevel(logging.DEBUG if args.verbose else logging.ERROR)
    from backends.hardware.commands import cmd_fit, cmd_hw, cmd_recommend

    handlers = {"models": cmd_models, "chat": cmd_chat, "bench": cmd_bench, "hw": cmd_hw, "fit": cmd_fit,
                "recommend": cmd_recommend, "datastore": cmd_datastore, "train": cmd_train,
                "serve": cmd_serve, "launch": cmd_launch}
    try:
        return handlers[args.command](args)
    except SpecDeckError as exc:
        print(f"specdeck: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # settings dataclasses validate their fields with ValueError
        print(f"specdeck: invalid setting: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nspecdeck: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
