"""Cache entries written by two threads of one process at once (the model load and a background
estimate read the same GGUF header on a fresh cache): both succeed, and the entry is whole.

This once failed a model load in the window: both threads wrote ``KEY.PID.tmp`` and renamed it,
so the second rename found its file gone ("[Errno 2] No such file or directory").
"""

from __future__ import annotations

import json
import threading

from backends.models.gguf_info import read_gguf_info
from backends.models.paths import write_atomic


def test_two_threads_writing_one_entry_both_succeed(tmp_path):
    target = tmp_path / "entry.json"
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def writer(n: int) -> None:
        start.wait()
        try:
            for i in range(300):
                write_atomic(target, json.dumps({"writer": n, "i": i}))
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and json.loads(target.read_text())["i"] == 299
    assert [p.name for p in tmp_path.iterdir()] == ["entry.json"]  # no temporary file left behind


def test_the_gguf_header_cache_on_a_fresh_cache_from_two_threads(tmp_path, monkeypatch, smollm_q4_path):
    results: list = []
    for round_ in range(5):
        monkeypatch.setenv("SPECDECK_CACHE_DIR", str(tmp_path / f"cache{round_}"))
        start = threading.Barrier(2)

        def read() -> None:
            start.wait()
            try:
                results.append(read_gguf_info(smollm_q4_path).n_layer)
            except BaseException as exc:  # noqa: BLE001
                results.append(exc)

        threads = [threading.Thread(target=read) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(results) == 10 and all(isinstance(r, int) for r in results), results


def _copies(model, folder, n: int) -> list:
    """``n`` names for one model file (hard links where the file system has them): to the caches,
    which key an entry by the file's path, these are ``n`` models."""
    import os
    import shutil

    folder.mkdir()
    out = []
    for i in range(n):
        name = folder / f"model{i}.gguf"
        try:
            os.link(model, name)
        except OSError:
            shutil.copyfile(model, name)
        out.append(name)
    return out


def test_the_gguf_header_cache_keeps_the_most_recently_used_entries(tmp_path, monkeypatch, smollm_q4_path):
    from backends.models import gguf_info

    monkeypatch.setenv("SPECDECK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_info, "_KEPT_INFOS", 2)
    a, b, c = _copies(smollm_q4_path, tmp_path / "models", 3)
    entry = {m: gguf_info._cache_path(m.resolve(), m.stat().st_size, m.stat().st_mtime_ns) for m in (a, b, c)}
    for model in (a, b, a, c):  # a is read again after b: b is the least recently used when c comes
        assert read_gguf_info(model).n_layer == 30
    assert sorted(p.name for p in (tmp_path / "cache" / "gguf-info").iterdir()) == sorted([entry[a].name, entry[c].name])


def test_dequantized_weights_are_kept_for_the_most_recent_models_only(tmp_path, monkeypatch, smollm_q4_path):
    """The PyTorch backend keeps a GGUF's weights dequantized (4 bytes a weight: 0.5 GB for this
    135M model). Keyed by path and time, they once piled up at 2 GB a test run, 29 GB in a day."""
    import pytest

    pytest.importorskip("torch")  # the test extra installs it; a GGUF-only install has no torch backend
    from backends.pytorch import weights

    monkeypatch.setenv("SPECDECK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(weights, "KEPT_DEQUANTIZED", 1)
    a, b = _copies(smollm_q4_path, tmp_path / "models", 2)
    shape_a, wa = weights.load_weights(a)
    shape_b, wb = weights.load_weights(b)
    kept = list((tmp_path / "cache" / "torch-weights").iterdir())
    assert [p.name for p in kept] == [weights._cache_file(b).name]
    assert shape_a == shape_b and all(bool((wa[k] == wb[k]).all()) for k in wa)
    again_shape, again = weights.load_weights(b)  # read back from the kept entry
    assert again_shape == shape_b and all(bool((again[k] == wb[k]).all()) for k in wb)


def test_an_entry_read_right_after_another_was_written_counts_as_the_newer(tmp_path):
    """The kernel's clock for file times ticks every few milliseconds: a hit right after another
    entry's write tied with it, and the tie went to the file names (half the time the wrong one)."""
    from backends.models.paths import keep_recent, mark_used

    for i in range(20):
        folder = tmp_path / str(i)
        names = ("a.json", "z.json") if i % 2 else ("z.json", "a.json")  # names that sort either way round
        old, new = folder / names[0], folder / names[1]
        write_atomic(old, "{}")
        write_atomic(new, "{}")
        keep_recent(folder, 2, "*.json", spare=new)  # what a writer does after writing ``new``
        mark_used(old)  # then ``old`` is read
        keep_recent(folder, 1, "*.json")
        assert [p.name for p in folder.iterdir()] == [old.name], i
