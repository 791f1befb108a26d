"""Hugging Face Hub search and resumable downloads, over real HTTP against a local Hub server.

The server (tests/hub_server.py) serves the bundled SmolLM2 GGUF file; every download below is
the real ``backends.models.hub`` code talking to it through ``huggingface_hub``.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from backends.core.errors import Cancelled, ModelFileError
from backends.models import hub
from backends.models.gguf_info import read_gguf_info
from tests.hub_server import HubRepo, HubServer

REPO = "bartowski/SmolLM2-135M-Instruct-GGUF"
MODEL_FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def server(smollm_q4_path):
    hubs = HubServer()
    hubs.add(HubRepo(REPO, {
        MODEL_FILE: Path(smollm_q4_path),
        "README.md": b"# SmolLM2 GGUF\n",
        "split/big-00001-of-00002.gguf": b"GGUF" + b"\0" * 20000,
        "split/big-00002-of-00002.gguf": b"GGUF" + b"\1" * 20000,  # every split part has its own header
        "pytorch_model.bin": b"\x80\x02pickle",
    }, downloads=500))
    hubs.add(HubRepo("someone/smollm-safetensors", {"config.json": b"{}", "model.safetensors": b"\0" * 64},
                     downloads=900, tags=("safetensors",)))
    hubs.add(HubRepo("other/SmolLM-gated-GGUF", {MODEL_FILE: b"GGUF"}, downloads=10, gated=True))
    endpoint = hubs.start()
    hubs.endpoint = endpoint
    yield hubs
    hubs.stop()


@pytest.fixture()
def fresh(server):
    server.rate, server.cut_after = None, None
    server.corrupt.clear()
    server.requests.clear()
    return server


def test_search_lists_gguf_repositories_most_downloaded_first(fresh):
    found = hub.search_models("smollm", endpoint=fresh.endpoint)
    assert [m.id for m in found] == [REPO, "other/SmolLM-gated-GGUF"]
    assert found[0].downloads == 500
    everything = hub.search_models("smollm", gguf_only=False, endpoint=fresh.endpoint)
    assert [m.id for m in everything][0] == "someone/smollm-safetensors"
    assert hub.search_models("no-such-model", endpoint=fresh.endpoint) == []


def test_file_list_has_sizes_checksums_and_kinds(fresh, smollm_q4_path):
    files = {f.path: f for f in hub.list_files(REPO, endpoint=fresh.endpoint)}
    model = files[MODEL_FILE]
    assert model.size == Path(smollm_q4_path).stat().st_size
    assert model.sha256 == _sha(Path(smollm_q4_path))
    assert files["README.md"].sha256 is None  # small files are not in LFS
    assert {f.kind for f in files.values()} == {"gguf", "other", "pickle"}


def test_selection_takes_every_part_of_a_split_model_and_refuses_pickles(fresh):
    files = hub.list_files(REPO, endpoint=fresh.endpoint)
    chosen = hub.expand_selection(files, ["split/big-00001-of-00002.gguf"])
    assert [f.path for f in chosen] == ["split/big-00001-of-00002.gguf", "split/big-00002-of-00002.gguf"]
    with pytest.raises(hub.HubError, match="pickled"):
        hub.expand_selection(files, ["pytorch_model.bin"])
    with pytest.raises(hub.HubError, match="not in this repository"):
        hub.expand_selection(files, ["missing.gguf"])


def test_download_puts_a_verified_model_in_the_library(fresh, tmp_path, smollm_q4_path):
    from desktop.library import scan_folder

    seen: list[tuple[str, int, int | None]] = []
    path = hub.download_file(REPO, MODEL_FILE, tmp_path, endpoint=fresh.endpoint,
                             progress=lambda stage, done, total: seen.append((stage, done, total)))
    assert path == tmp_path / "bartowski" / "SmolLM2-135M-Instruct-GGUF" / MODEL_FILE
    assert _sha(path) == _sha(Path(smollm_q4_path))
    assert read_gguf_info(path).architecture == "llama"
    assert [e.path for e in scan_folder(tmp_path)] == [path]
    assert hub.partial_files(tmp_path) == []
    size = path.stat().st_size
    downloaded = [d for stage, d, _ in seen if stage == "download"]
    assert downloaded == sorted(downloaded) and downloaded[-1] == size
    assert seen[-1] == ("verify", size, size)  # the sha256 check reads the whole file after the transfer
    # A second request finds it in place and transfers nothing.
    fresh.requests.clear()
    assert hub.download_file(REPO, MODEL_FILE, tmp_path, endpoint=fresh.endpoint) == path
    assert [m for m, *_ in fresh.requests] == ["HEAD"]


def test_cancelled_download_is_not_listed_and_resumes_where_it_stopped(fresh, tmp_path, smollm_q4_path):
    from desktop.library import scan_folder

    fresh.rate = 40e6  # 40 MB/s: the 98 MB file takes long enough to cancel mid-way
    cancel = threading.Event()

    def stop_after_first_chunk(stage: str, done: int, total: int | None) -> None:
        cancel.set()

    with pytest.raises(Cancelled):
        hub.download_file(REPO, MODEL_FILE, tmp_path, endpoint=fresh.endpoint,
                          progress=stop_after_first_chunk, cancel=cancel)
    assert scan_folder(tmp_path) == []
    [part] = hub.partial_files(tmp_path)
    kept = part.stat().st_size
    assert 0 < kept < Path(smollm_q4_path).stat().st_size

    fresh.rate, cancel = None, threading.Event()
    fresh.requests.clear()
    path = hub.download_file(REPO, MODEL_FILE, tmp_path, endpoint=fresh.endpoint, cancel=cancel)
    assert ("GET", f"/{REPO}/resolve/main/{MODEL_FILE}", f"bytes={kept}-") in fresh.requests
    assert _sha(path) == _sha(Path(smollm_q4_path))
    assert hub.partial_files(tmp_path) == []


def test_dropped_connection_is_resumed_within_the_same_download(fresh, tmp_path, smollm_q4_path):
    fresh.cut_after = 3 << 20
    path = hub.download_file(REPO, MODEL_FILE, tmp_path, endpoint=fresh.endpoint)
    assert any(rng and rng.startswith("bytes=") for _, _, rng in fresh.requests)
    assert _sha(path) == _sha(Path(smollm_q4_path))


def test_corrupt_bytes_are_deleted_with_a_clear_error(fresh, tmp_path):
    fresh.corrupt.add(f"{REPO}/{MODEL_FILE}")
    with pytest.raises(ModelFileError, match="corrupt: its sha256"):
        hub.download_file(REPO, MODEL_FILE, tmp_path, endpoint=fresh.endpoint)
    assert list(tmp_path.rglob("*.gguf")) == [] and hub.partial_files(tmp_path) == []


def test_a_partial_of_an_older_version_is_dropped(fresh, tmp_path):
    dest = hub.local_path(tmp_path, REPO, "split/big-00002-of-00002.gguf")
    dest.parent.mkdir(parents=True)
    stale = dest.with_name(dest.name + ".0ldversi0n.part")
    stale.write_bytes(b"x" * 100)
    hub.download_file(REPO, "split/big-00002-of-00002.gguf", tmp_path, endpoint=fresh.endpoint)
    assert not stale.exists() and dest.read_bytes() == b"GGUF" + b"\1" * 20000


def test_hub_failures_are_readable(fresh, tmp_path):
    with pytest.raises(hub.HubError, match="no such repository"):
        hub.list_files("nobody/nothing", endpoint=fresh.endpoint)
    with pytest.raises(hub.HubError, match="no such file"):
        hub.download_file(REPO, "missing.gguf", tmp_path, endpoint=fresh.endpoint)
    with pytest.raises(hub.HubError, match="gated.*hf auth login"):
        hub.download_file("other/SmolLM-gated-GGUF", MODEL_FILE, tmp_path, endpoint=fresh.endpoint)
    with pytest.raises(hub.HubError, match="outside the library folder"):
        hub.download_file(REPO, "../escape.gguf", tmp_path, endpoint=fresh.endpoint)
    with pytest.raises(hub.HubError, match="not enough disk space"):
        hub._check_disk_space(tmp_path, 1 << 62)
    assert list(tmp_path.rglob("*")) == []


def test_a_dead_hub_is_reported_not_raised_raw(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(hub.HubError, match="cannot reach the Hugging Face Hub"):
        hub.search_models("smollm", endpoint=dead)
    with pytest.raises(hub.HubError, match="cannot reach the Hugging Face Hub"):
        hub.download_file(REPO, MODEL_FILE, tmp_path, endpoint=dead)


def test_several_files_download_in_one_job_with_overall_progress(fresh, tmp_path):
    files = hub.expand_selection(hub.list_files(REPO, endpoint=fresh.endpoint), ["split/big-00001-of-00002.gguf"])
    state = hub.DownloadProgress(files=len(files), total_bytes=sum(f.size for f in files))
    hub.download_files(REPO, files, tmp_path, state, endpoint=fresh.endpoint)
    assert state.finished and state.error is None and not state.cancelled
    assert state.done_bytes == state.total_bytes == 40008
    assert [p.name for p in state.paths] == ["big-00001-of-00002.gguf", "big-00002-of-00002.gguf"]

    broken = hub.DownloadProgress(files=1, total_bytes=1)
    hub.download_files(REPO, [hub.HubFile("missing.gguf", 1, None)], tmp_path, broken, endpoint=fresh.endpoint)
    assert broken.finished and "no such file" in broken.error


# --- the dialog, as a person uses it -------------------------------------------------------


@pytest.fixture()
def library(qtbot, fresh, tmp_path, monkeypatch):
    from desktop.jobs import wait_for_jobs
    from desktop.library import ModelLibrary

    monkeypatch.setenv("SPECDECK_DATA_DIR", str(tmp_path / "data"))
    lib = ModelLibrary([], hub_endpoint=fresh.endpoint)
    qtbot.addWidget(lib)
    yield lib
    lib.shutdown()
    wait_for_jobs()


def _wait_done(qtbot, dialog) -> None:
    try:
        qtbot.waitUntil(lambda: not dialog.busy and dialog.status.text().startswith("Done"), timeout=60_000)
    except Exception:
        raise AssertionError(f"download did not finish: {dialog.status.text()!r}") from None


def _pick_file(qtbot, dialog, name: str) -> None:
    from PySide6.QtCore import QItemSelectionModel

    dialog.query.setText("smollm")
    dialog.search()
    qtbot.waitUntil(lambda: dialog.results.rowCount() == 2, timeout=10_000)
    flags = QItemSelectionModel.SelectionFlag.ClearAndSelect | QItemSelectionModel.SelectionFlag.Rows
    dialog.results.selectionModel().setCurrentIndex(dialog.results.model().index(0, 0), flags)
    qtbot.waitUntil(lambda: dialog.file_table.rowCount() == 5, timeout=10_000)
    dialog.select_files([name])


def test_dialog_downloads_into_the_library_which_then_lists_the_model(qtbot, library, fresh):
    from PySide6.QtCore import Qt

    dialog = library.open_hub()
    _pick_file(qtbot, dialog, MODEL_FILE)
    pickle_row = next(r for r, f in enumerate(dialog.files) if f.kind == "pickle")
    assert not dialog.file_table.item(pickle_row, 0).flags() & Qt.ItemFlag.ItemIsEnabled
    assert "pickled" in dialog.file_table.item(pickle_row, 2).text()
    assert dialog.selected_paths() == [MODEL_FILE]
    dialog.download_button.click()
    _wait_done(qtbot, dialog)
    assert dialog.progress.value() == 1000
    listed = [e.path for e in library.entries if e.path and e.path.name == MODEL_FILE]
    assert listed and listed[0].is_file()
    row = library._row_of(str(listed[0]))
    qtbot.waitUntil(lambda: library.table.item(row, 1) is not None, timeout=30_000)
    assert library.table.item(row, 1).text() == "llama"
    assert "in the library" in dialog.file_table.item(0, 2).text()


def test_dialog_cancel_keeps_the_library_clean_and_download_resumes(qtbot, library, fresh):
    dialog = library.open_hub()
    _pick_file(qtbot, dialog, MODEL_FILE)
    fresh.rate = 20e6
    dialog.download_button.click()
    qtbot.waitUntil(lambda: dialog.progress.value() > 0, timeout=30_000)
    dialog.cancel_button.click()
    qtbot.waitUntil(lambda: not dialog.busy, timeout=30_000)
    qtbot.waitUntil(lambda: dialog.status.text().startswith("Cancelled"), timeout=5_000)
    assert not any(e.path and e.path.name == MODEL_FILE for e in library.entries)
    assert "downloaded; Download resumes it" in dialog.file_table.item(0, 2).text()
    fresh.rate = None
    dialog.select_files([MODEL_FILE])
    dialog.download_button.click()
    _wait_done(qtbot, dialog)
    assert any(rng and rng != "bytes=0-" for _, _, rng in fresh.requests)
    assert any(e.path and e.path.name == MODEL_FILE for e in library.entries)


def test_dialog_shows_hub_errors_and_keeps_working(qtbot, library, fresh):
    dialog = library.open_hub()
    dialog.endpoint = "http://127.0.0.1:9"  # nothing listens on the discard port
    dialog.query.setText("smollm")
    dialog.search()
    qtbot.waitUntil(lambda: "cannot reach" in dialog.status.text(), timeout=30_000)
    assert "c0392b" in dialog.status.styleSheet()
    dialog.endpoint = fresh.endpoint
    _pick_file(qtbot, dialog, "pytorch_model.bin")  # disabled: selecting it selects nothing
    dialog.download_button.click()
    assert not dialog.busy and "Select one or more files" in dialog.status.text()


def test_command_line_search_files_and_download(fresh, tmp_path, capsys, smollm_q4_path):
    from backends.cli import main

    assert main(["models", "search", "smollm", "--endpoint", fresh.endpoint]) == 0
    assert REPO in capsys.readouterr().out
    assert main(["models", "files", REPO, "--endpoint", fresh.endpoint]) == 0
    assert "(pickle: refused)" in capsys.readouterr().out
    assert main(["models", "download", REPO, MODEL_FILE, "--out", str(tmp_path), "--endpoint", fresh.endpoint]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert _sha(path) == _sha(Path(smollm_q4_path))
    assert main(["models", "download", REPO, "pytorch_model.bin", "--out", str(tmp_path),
                 "--endpoint", fresh.endpoint]) == 2
    assert "pickled weights" in capsys.readouterr().err
