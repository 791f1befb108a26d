"""EAGLE-3 heads published on the Hub, found for the loaded model, checked and kept (issue 18).

A local Hub server (tests/hub_server.py) holds head repositories in the EAGLE / SpecForge layout:
one made for SmolLM2-135M, one for a bigger SmolLM2 (another size in its name), one whose config
says another vocabulary, and one with pickled weights only. The real search, download and
conversion code runs against it over HTTP.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from backends.heads.files import HeadFile, find_heads
from backends.models.hub import DownloadProgress
from tests.hub_server import HubRepo, HubServer
from tests.test_eagle3 import smollm_shaped_head, write_published

FITS = "someone/EAGLE3-SmolLM2-135M-Instruct"
OTHER_SIZE = "someone/EAGLE3-SmolLM2-1.7B-Instruct"
OTHER_VOCAB = "vendor/sglang-EAGLE3-SmolLM2-135M-SpecForge"
PICKLED = "old/SmolLM2-135M_eagle3"


def _repo(repo_id: str, folder: Path, downloads: int) -> HubRepo:
    return HubRepo(repo_id, {p.name: p for p in sorted(folder.iterdir())}, downloads=downloads, tags=())


@pytest.fixture(scope="module")
def heads_hub(smollm_q4_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    head = smollm_shaped_head(smollm_q4_path, seed=7)
    write_published(head, root / "fits", 49152)
    write_published(head, root / "vocab", 128256)
    (root / "pickled").mkdir()
    (root / "pickled" / "config.json").write_text((root / "fits" / "config.json").read_text())
    (root / "pickled" / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    hubs = HubServer()
    hubs.add(_repo(FITS, root / "fits", 50))
    hubs.add(_repo(OTHER_SIZE, root / "fits", 900))
    hubs.add(_repo(OTHER_VOCAB, root / "vocab", 500))
    hubs.add(_repo(PICKLED, root / "pickled", 5))
    hubs.add(HubRepo("bartowski/SmolLM2-135M-Instruct-GGUF", {"model.gguf": b"GGUF"}, downloads=10_000))
    hubs.endpoint = hubs.start()
    yield hubs, head
    hubs.stop()


@pytest.fixture()
def user(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDECK_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("SPECDECK_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def test_name_matching_needs_the_model_size_and_a_word_of_its_name():
    from backends.heads.from_hub import head_score, name_words

    words = name_words("Meta-Llama-3.1-8B-Instruct-Q4_K_M")
    assert head_score("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", words) > 0
    assert head_score("lmsys/sglang-EAGLE3-Llama-3.1-8B-Instruct-SpecForge", words) > 0
    assert head_score("yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", words) == 0  # another size
    assert head_score("AngelSlim/Qwen3-8B_eagle3", words) == 0  # another model of that size


def test_heads_for_the_model_are_found_checked_before_their_weights_and_kept(heads_hub, user, smollm_q4_path):
    from backends.heads.from_hub import install_head, search_heads

    hubs, head = heads_hub
    found = [m.id for m in search_heads(smollm_q4_path, endpoint=hubs.endpoint)]
    assert set(found) == {FITS, OTHER_VOCAB, PICKLED}  # not the 1.7B one, not the model repository
    state = DownloadProgress(files=1, total_bytes=0)
    install_head(FITS, smollm_q4_path, state, endpoint=hubs.endpoint)
    assert state.error is None and state.result is not None and state.finished
    assert state.done_bytes == state.total_bytes > 0
    assert state.result in find_heads(smollm_q4_path, "eagle3")  # eagle3 and eagle3-native find it
    kept = HeadFile.load(state.result)
    for name, value in head.tensors.items():
        assert np.array_equal(kept.tensors[name], value), name
    assert kept.training["hub"] == FITS
    assert not list((user / "cache").rglob("*.safetensors"))  # the download is not kept twice

    hubs.requests.clear()
    refused = DownloadProgress(files=1, total_bytes=0)
    install_head(OTHER_VOCAB, smollm_q4_path, refused, endpoint=hubs.endpoint)
    assert refused.result is None and "vocabulary 128256 vs 49152" in refused.error
    assert not any(path.endswith(".safetensors") for _, path, _ in hubs.requests)  # refused before the weights came
    pickled = DownloadProgress(files=1, total_bytes=0)
    install_head(PICKLED, smollm_q4_path, pickled, endpoint=hubs.endpoint)
    assert pickled.result is None and "pickles" in pickled.error
    assert find_heads(smollm_q4_path, "eagle3").count(state.result) == 1  # nothing else was kept


def test_the_dialog_finds_and_installs_a_head_for_the_loaded_model(qtbot, heads_hub, user, smollm_q4_path):
    from PySide6.QtCore import QItemSelectionModel

    from desktop.hub import HubDialog

    hubs, _ = heads_hub
    dialog = HubDialog(hubs.endpoint, root=user / "library")
    qtbot.addWidget(dialog)
    assert not dialog.heads_button.isEnabled()  # no model loaded
    dialog.set_model(str(smollm_q4_path))
    assert dialog.heads_button.isEnabled() and Path(smollm_q4_path).stem in dialog.heads_button.text()
    dialog.heads_button.click()
    qtbot.waitUntil(lambda: dialog.results.rowCount() == 3, timeout=10_000)
    rows = [dialog.results.item(r, 0).text() for r in range(3)]
    flags = QItemSelectionModel.SelectionFlag.ClearAndSelect | QItemSelectionModel.SelectionFlag.Rows
    dialog.results.selectionModel().setCurrentIndex(dialog.results.model().index(rows.index(FITS), 0), flags)
    qtbot.waitUntil(lambda: dialog.repo == FITS, timeout=10_000)
    with qtbot.waitSignal(dialog.head_installed, timeout=60_000) as installed:
        dialog.download_button.click()
    saved = Path(installed.args[0])
    assert saved in find_heads(smollm_q4_path, "eagle3")
    qtbot.waitUntil(lambda: dialog.status.text().startswith("Done"), timeout=5_000)
    assert saved.name in dialog.status.text()
    assert not (user / "library").exists() or not any((user / "library").rglob("*.safetensors"))  # not a model
    dialog.shutdown()
