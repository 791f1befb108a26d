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
