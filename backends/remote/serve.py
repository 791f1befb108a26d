"""``specdeck serve``: llama-cpp-python's own OpenAI-compatible server, on the llama.cpp code
SpecDeck chose for this PC.

Why not plain ``python -m llama_cpp.server``: SpecDeck's llama.cpp build keeps its CPU variants
(and GPU backends) as loadable modules and loads only the one a child-process probe saw run here
(``backends.models.llama_runtime``). llama-cpp-python's server loads none by itself and stops with
"no backends are loaded". This wrapper loads them first, resolves SpecDeck's model ids
(``--model smollm2-135m-q4_1``) to files, then hands every other argument to that server
unchanged (``--port``, ``--n_ctx``, ``--draft_model prompt-lookup-decoding`` ...). The API key is
best given as the environment variable ``API_KEY`` (which the server reads), not ``--api_key``,
which every user of the machine can read from the process list.

Example: ``specdeck serve --model smollm2-135m-q4_1 --port 8081 --draft_model prompt-lookup-decoding``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from backends.core.errors import SpecDeckError


def resolve_model_argument(argv: list[str]) -> list[str]:
    """``argv`` with a SpecDeck model id after ``--model`` replaced by its file's path."""
    from backends.models.catalog import resolve_model

    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg == "--model" and not Path(out[i + 1]).exists():
            out[i + 1] = str(resolve_model(out[i + 1]))
    return out


def main(argv: list[str] | None = None) -> int:
    """Start the server (it runs until interrupted)."""
    try:
        from llama_cpp.server.__main__ import main as server_main
    except ImportError as exc:
        raise SpecDeckError("the server needs llama-cpp-python's server extra: "
                            "pip install 'specdeck[server]' (fastapi, uvicorn, sse-starlette ...)") from exc
    from backends.models.llama_lib import llama

    args = resolve_model_argument(list(sys.argv[1:] if argv is None else argv))
    llama()  # the probed CPU module (and GPU module) load before the server's first model
    sys.argv = ["specdeck serve", *args]
    server_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
