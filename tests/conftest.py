"""Shared fixtures: real models from the catalog, loaded once per test session."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # keep numpy's BLAS threads off llama.cpp's cores
# What SpecDeck learns while tests run (observed speeds) must not land in the user's data directory.
os.environ.setdefault("SPECDECK_DATA_DIR", tempfile.mkdtemp(prefix="specdeck-test-data-"))

import pytest  # noqa: E402

from backends.factory import Session, SessionConfig  # noqa: E402
from backends.models.catalog import resolve_model  # noqa: E402

PROMPTS = [
    "Summarize in one sentence: The city council met on Tuesday to discuss the new park. The park will "
    "have a playground, a pond and a running track. Construction starts in May and ends in October.",
    "Repeat this list exactly: apples, pears, plums, cherries, grapes, melons, lemons, limes.",
    "Fix the bug in this Python function and show the corrected code:\n"
    "def add(a, b):\n    return a - b\n",
    "What is the capital of France? Answer in one word.",
    "Write a haiku about autumn leaves.",
    "Translate to German: The weather is nice today and the children play in the garden.",
    "List the first ten even numbers separated by commas.",
    "Explain in two sentences why the sky is blue.",
    "Rewrite in the past tense: I walk to the store, I buy bread, and I go home.",
    "Question: Tom has 3 apples and buys 5 more. How many apples does he have? Answer:",
]


@pytest.fixture(scope="session")
def smollm_f16_path():
    return resolve_model("smollm2-135m-f16")


@pytest.fixture(scope="session")
def smollm_q4_path():
    return resolve_model("smollm2-135m-q4_1")


@pytest.fixture(scope="session")
def gemma_path():
    return resolve_model("gemma3-270m-q4_k_m")


@pytest.fixture(scope="session")
def gemma_f16_path():
    return resolve_model("gemma3-270m-f16")


@pytest.fixture(scope="session")
def smollm_hf_built(smollm_f16_path, tmp_path_factory) -> Path:
    """SmolLM2 F16 as a Hub download has it (config.json, two safetensors shards, the tokenizer's
    files), written once per run: transformers takes some 20 s to read the GGUF, and four tests need it."""
    AutoTokenizer = pytest.importorskip("transformers").AutoTokenizer

    from tests.test_torch_backend import reference, write_hf_folder

    folder = write_hf_folder(reference(smollm_f16_path.parent, smollm_f16_path.name),
                             tmp_path_factory.mktemp("hugging-face") / "smollm2")
    AutoTokenizer.from_pretrained(str(smollm_f16_path.parent), gguf_file=smollm_f16_path.name).save_pretrained(str(folder))
    return folder


@pytest.fixture
def smollm_hf_folder(smollm_hf_built):
    """Puts a copy of that folder where a test wants it (``place(dest)``): hard links where the file
    system allows, since the tests read the files and never write into them."""
    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    def place(dest: Path) -> Path:
        shutil.copytree(smollm_hf_built, dest, copy_function=link_or_copy)
        return dest

    return place


@pytest.fixture(scope="session")
def smollm_session(smollm_f16_path, smollm_q4_path):
    """SmolLM2 F16 target with the Q4_1 file as draft model."""
    with Session(SessionConfig(model=str(smollm_f16_path), draft_model=str(smollm_q4_path), n_ctx=2048)) as s:
        yield s


@pytest.fixture(scope="session")
def gemma_session(gemma_f16_path, gemma_path):
    """Gemma-3-270M F16 target with the Q4_K_M file as draft model."""
    with Session(SessionConfig(model=str(gemma_f16_path), draft_model=str(gemma_path), n_ctx=2048)) as s:
        yield s
