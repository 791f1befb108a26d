"""GGUF metadata, the model catalog with derived variants, vocabulary compatibility, chat formats."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from backends.llamacpp.model import LlamaModel
from backends.models import catalog
from backends.models.catalog import CatalogEntry, ensure, is_present, list_models, resolve_model
from backends.models.chat import ChatFormat
from backends.models.compat import draft_incompatibility
from backends.models.gguf_info import read_gguf_info


def test_gguf_info_smollm2(smollm_q4_path):
    info = read_gguf_info(smollm_q4_path)
    assert info.architecture == "llama" and info.n_layer == 30 and info.n_embd == 576
    assert info.n_head == 9 and info.n_head_kv == 3 and info.n_ctx_train == 8192
    assert info.vocab.kind == "gpt2" and info.vocab.n_vocab == 49152 and len(info.vocab.tokens) == 49152
    assert info.vocab.bos == 1 and info.vocab.eos == 2 and not info.vocab.add_bos
    assert info.file_type == "Q4_1" and "im_start" in info.chat_template
    assert len(info.tensors) == 272
    assert 0.95 * info.file_size < info.weights_bytes < info.file_size  # exact tensor sizes + header
    assert 130e6 < info.n_params < 140e6
    embd = next(t for t in info.tensors if t.name == "token_embd.weight")
    assert embd.shape == (576, 49152) and embd.ggml_type == "Q8_0"


def test_gguf_info_gemma_and_cache(gemma_path):
    info = read_gguf_info(gemma_path)
    assert info.architecture == "gemma3" and info.n_layer == 18 and info.sliding_window == 512
    assert info.n_head_kv == 1 and info.key_length == 256 and info.vocab.n_vocab == 262144
    assert info.chat_template is None
    start = time.perf_counter()
    again = read_gguf_info(gemma_path)  # from the JSON cache: no 262k-token parse
    assert time.perf_counter() - start < 2.0
    assert again == info


@pytest.mark.parametrize("fixture", ["smollm_q4_path", "smollm_f16_path", "gemma_path"])
def test_weights_read_at_the_header_offsets_are_the_gguf_librarys(fixture, request):
    """Heads read the target's embedding and output rows, and the PyTorch backend whole tensors
    and the architecture's keys, through SpecDeck's header reader (Q4_1, F16, Q4_K_M files here):
    the same values as ``gguf.GGUFReader`` gives, without parsing every token string again (a
    head's start took 2-10 s; a first Gemma load on torch 9.8 s more)."""
    import gguf
    import numpy as np

    from backends.models.weights import EMBEDDINGS, OUTPUT, TokenEmbeddings, gguf_array, tensor_rows
    from backends.pytorch.weights import read_gguf

    path = request.getfixturevalue(fixture)
    reader = gguf.GGUFReader(str(path))
    theirs = {t.name: t for t in reader.tensors}
    info = read_gguf_info(path)
    ours = {t.name: t for t in info.tensors}
    assert {n: int(t.data_offset) for n, t in theirs.items()} == {n: t.offset for n, t in ours.items()}
    rows = np.array([0, 1, 17, 4000, ours[EMBEDDINGS[0]].shape[1] - 1])
    for names, got in ((EMBEDDINGS, TokenEmbeddings(path)(rows)), (OUTPUT, tensor_rows(path, rows))):
        tensor = next(theirs[n] for n in names if n in theirs)
        expected = gguf.quants.dequantize(tensor.data[rows], tensor.tensor_type)
        assert got.dtype == np.float32 and np.array_equal(got, expected), (fixture, tensor.name)
    for name, tensor in theirs.items():
        got = gguf_array(path, ours[name])
        expected = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        assert got.shape == expected.shape and np.array_equal(got, expected), (fixture, name)
    arch = info.architecture
    assert info.metadata == {k: f.contents() for k, f in reader.fields.items() if k.startswith(f"{arch}.")}
    shape, weights = read_gguf(path)  # what the PyTorch backend dequantizes and caches
    assert shape.family == arch and shape.n_layer == info.n_layer and len(weights) > shape.n_layer


def test_metadata_agrees_with_llama_cpp(smollm_q4_path):
    info = read_gguf_info(smollm_q4_path)
    with LlamaModel(smollm_q4_path) as model:
        assert model.n_vocab == info.vocab.n_vocab and model.n_layer == info.n_layer
        assert model.vocab_info.tokens[:100] == info.vocab.tokens[:100]
        assert draft_incompatibility(info.vocab, model.vocab_info) == []


def test_vocabulary_compatibility_rules(smollm_q4_path, gemma_path):
    smol = read_gguf_info(smollm_q4_path).vocab
    gemma = read_gguf_info(gemma_path).vocab
    assert draft_incompatibility(smol, smol) == []
    reasons = draft_incompatibility(smol, gemma)
    assert any("tokenizer type" in r for r in reasons) and any("sizes differ" in r for r in reasons)
    changed = list(smol.tokens)
    changed[1000] = "something else"
    from dataclasses import replace

    assert draft_incompatibility(smol, replace(smol, tokens=tuple(changed))) == [
        f"token 1000 differs ('something else' vs {smol.tokens[1000]!r})"
    ]
    assert draft_incompatibility(smol, replace(smol, tokens=("x",) * 5 + smol.tokens[5:])) == []  # ids < 5 free
    assert any("add-BOS" in r for r in draft_incompatibility(smol, replace(smol, add_bos=True)))
    assert draft_incompatibility(smol, replace(smol, n_vocab=smol.n_vocab + 100)) == []


def test_known_ids_and_paths_resolve(smollm_q4_path):
    assert resolve_model("smollm2-135m-q4_1") == smollm_q4_path
    assert resolve_model(str(smollm_q4_path)) == smollm_q4_path
    ids = {row["id"] for row in list_models()}
    assert {"smollm2-135m-q4_1", "smollm2-135m-f16", "smollm2-135m-q8_0", "gemma3-270m-q4_k_m", "gemma3-270m-f16"} <= ids


def test_derived_variant_is_made_reused_and_remade(tmp_path, monkeypatch, smollm_q4_path):
    monkeypatch.setenv("SPECDECK_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "src.gguf"
    shutil.copyfile(smollm_q4_path, src)
    monkeypatch.setitem(catalog.CATALOG, "test-src", CatalogEntry("test-src", "test source", locate=lambda: src))
    monkeypatch.setitem(catalog.CATALOG, "test-q8", CatalogEntry("test-q8", "derived", source="test-src", ftype="Q8_0"))
    assert not is_present("test-q8")
    path = ensure("test-q8")
    assert path.exists() and is_present("test-q8")
    assert read_gguf_info(path, use_cache=False).file_type == "Q8_0"
    assert not list(path.parent.glob("*.tmp"))  # no half files
    made = path.stat().st_mtime_ns
    assert ensure("test-q8") == path and path.stat().st_mtime_ns == made  # reused
    os.utime(src, ns=(time.time_ns(), time.time_ns() + 10**9))  # the source changed
    assert not is_present("test-q8")
    ensure("test-q8")
    assert path.stat().st_mtime_ns != made
    assert json.loads(path.with_name(path.name + ".stamp.json").read_text())["ftype"] == "Q8_0"


def test_chat_format_template_and_plain_fallback(smollm_q4_path):
    with LlamaModel(smollm_q4_path) as model:
        text = model.chat_format.render([{"role": "user", "content": "Hi"}])
        assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in text
        tokens = model.chat_prompt([{"role": "user", "content": "Hi"}])
        assert tokens[0] == model.tokenize("<|im_start|>", add_special=False)[0]
    plain = ChatFormat(template=None)
    assert plain.render([{"role": "user", "content": "Hi"}]) == "User: Hi\nAssistant:"
    assert plain.stop == ("\nUser:",)


def test_gemma_prompt_gets_one_bos(gemma_path):
    with LlamaModel(gemma_path) as model:
        tokens = model.chat_prompt([{"role": "user", "content": "Hi"}])
        assert tokens[0] == model.bos and tokens[1] != model.bos


def test_catalog_error_lists_known_ids():
    with pytest.raises(Exception, match="known: smollm2-135m-q4_1"):
        resolve_model("definitely-not-a-model")
    assert isinstance(resolve_model.__doc__, str)
    assert Path(catalog.entry_path("smollm2-135m-f16")).name == "smollm2-135m-f16.gguf"
