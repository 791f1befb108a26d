"""EAGLE-3 heads published on the Hugging Face Hub, found for the loaded model and kept as its own.

People who train EAGLE-3 heads (SafeAILab's EAGLE, SpecForge, vendors) publish them as Hub
repositories named after the model they were made for ("EAGLE3-LLaMA3.1-Instruct-8B",
"sglang-EAGLE3-Llama-3.1-8B-Instruct-SpecForge", "Qwen3-8B_eagle3"). The Hub has no field that
links a head to its model, so finding one is a search for "eagle3" ranked by how much of the
model's name (its family word and its size, "llama" and "8b") the repository's name shares.

Installing one fetches ``config.json`` first and checks it against the model (vocabulary, width,
layers: ``published.head_shape``), so a head for another model is refused, with what differs,
before hundreds of megabytes of weights are downloaded; then the safetensors weights (pickles
are never fetched), read into a SpecDeck head (``read_published_eagle3``) and saved among the
user's heads, named after the model and the repository, where ``find_heads`` finds it for the
``eagle3`` and ``eagle3-native`` methods like a head trained here (the downloaded files are then
deleted: the kept head holds the weights).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from pathlib import Path, PurePosixPath

from backends.core.errors import ModelFileError
from backends.heads.eagle3 import KIND
from backends.heads.files import ModelFingerprint, user_heads_dir
from backends.heads.published import head_shape, read_published_eagle3
from backends.models.gguf_info import read_gguf_info
from backends.models.hub import (
    DownloadProgress,
    HubError,
    HubFile,
    HubModel,
    fetch_files,
    list_files,
    local_path,
    reporting,
    search_models,
)
from backends.models.paths import cache_dir

QUERY = "eagle3"  # every published EAGLE-3 head's repository name has it (EAGLE3-..., ..._eagle3)
SEARCHED = 500  # repositories read from the search, most downloaded first, before ranking by name
_TOKEN = re.compile(r"\d+(?:\.\d+)?[bm](?![a-z])|[a-z]+|\d+(?:\.\d+)?")
_SIZE = re.compile(r"^\d+(?:\.\d+)?[bm]$")
# words in model and repository names that say nothing about which model it is
_GENERIC = frozenset("""eagle eagle3 gguf instruct chat it base hf meta sglang specforge draft head
    model models speculative q k m s l xl f bf fp int ud iq imatrix""".split())


def name_tokens(name: str) -> set[str]:
    """The words and numbers of a model or repository name: "Llama-3.1-8B-Instruct-Q4_K_M" ->
    {"llama", "3.1", "8b", "instruct", "q", "4", "k", "m"} (a size like 8B or 135M stays one word)."""
    return set(_TOKEN.findall(name.lower()))


def name_words(name: str) -> set[str]:
    """The tokens of a name that say which model it is (less "instruct", "gguf", quant letters)."""
    return name_tokens(name) - _GENERIC


def model_words(model: str | os.PathLike) -> set[str]:
    """What names the model: its file name's and its header's name's words."""
    return name_words(Path(model).stem) | name_words(read_gguf_info(model).name or "")


def head_score(repo_id: str, words: set[str]) -> int:
    """How much of the model's name a head repository's name shares; 0 when it cannot be for this
    model: it must name the model's size (when the model's name has one) and one of its words."""
    theirs = name_words(PurePosixPath(repo_id).name)
    shared = theirs & words
    sizes = {w for w in words if _SIZE.match(w)}
    if (sizes and not sizes & theirs) or not any(w.isalpha() for w in shared):
        return 0
    return len(shared)


def search_heads(model: str | os.PathLike, *, limit: int = 20, endpoint: str | None = None) -> list[HubModel]:
    """EAGLE-3 head repositories whose names fit ``model``'s, the best fitting first."""
    words = model_words(model)
    found = search_models(QUERY, gguf_only=False, limit=SEARCHED, endpoint=endpoint)
    scored = [(head_score(m.id, words), m) for m in found]
    ranked = sorted((sm for sm in scored if sm[0] > 0), key=lambda sm: (-sm[0], -sm[1].downloads))
    return [m for _, m in ranked[:limit]]


def head_files(files: list[HubFile]) -> tuple[HubFile, list[HubFile]]:
    """A head repository's ``config.json`` and its safetensors weights (at the top: a repository may
    keep other things in folders); a repository with pickled weights only is refused."""
    top = [f for f in files if "/" not in f.path]
    config = next((f for f in top if f.path == "config.json"), None)
    weights = [f for f in top if f.kind == "safetensors"]
    if config is None:
        raise HubError("this repository has no config.json: it is not an EAGLE-3 head in the EAGLE / SpecForge layout")
    if not weights:
        pickled = [f.path for f in top if f.kind == "pickle"]
        raise HubError("this repository has no safetensors weights" + (
            f" ({', '.join(pickled)} are pickles, which SpecDeck never loads)" if pickled else ""))
    return config, weights


def install_head(repo_id: str, model: str | os.PathLike, state: DownloadProgress, *,
                 endpoint: str | None = None, cancel: threading.Event | None = None) -> None:
    """Fetch, check and keep the head in ``repo_id`` for ``model``; publishes progress in ``state``
    and the saved head's JSON in ``state.result``. Never raises (it runs on a download thread)."""
    with reporting(state, repo_id):
        config, weights = head_files(list_files(repo_id, endpoint=endpoint))
        state.files, state.total_bytes = 1 + len(weights), config.size + sum(f.size for f in weights)
        root = cache_dir() / "hub-heads"
        fetch_files(repo_id, [config], root, state, endpoint=endpoint, cancel=cancel)
        folder = local_path(root, repo_id, config.path).parent
        try:
            head_shape(json.loads((folder / "config.json").read_text()), ModelFingerprint.of(model), repo_id)
        except ValueError as exc:
            raise ModelFileError(f"{repo_id}: its config.json is not JSON ({exc})") from None
        fetch_files(repo_id, weights, root, state, endpoint=endpoint, cancel=cancel)
        head = read_published_eagle3(folder, model)
        head.training["hub"] = repo_id
        state.result = head.save(saved_stem(model, repo_id))
        shutil.rmtree(folder, ignore_errors=True)  # the kept head holds its weights; do not keep them twice


def saved_stem(model: str | os.PathLike, repo_id: str) -> Path:
    """Where a head from the Hub is kept for ``model``: among the user's heads, named after both
    (beside, not over, a head trained here)."""
    slug = re.sub(r"[^0-9A-Za-z_.-]+", "-", repo_id.replace("/", "--"))
    return user_heads_dir() / f"{Path(model).stem}.{slug}.{KIND}"
