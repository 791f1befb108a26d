"""``specdeck-gui --self-test``, as an installer's smoke test runs it: the real app in a process
of its own on the offscreen platform, the bundled model, one question answered; a model that
cannot load fails it with the reason. The user's conversations and settings are not touched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _self_test(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", HOME=str(tmp_path / "home"),
               XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_DATA_HOME=str(tmp_path / "share"))
    return subprocess.run([sys.executable, "-m", "desktop", "--self-test", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_the_self_test_answers_with_the_bundled_model_and_leaves_no_trace(tmp_path):
    done = _self_test(tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("self-test: OK") and "first token" in line and " tokens by " in line
    assert not (tmp_path / "share").exists() and not (tmp_path / "config").exists()  # nothing of the user's


def test_the_self_test_fails_in_words_when_the_model_cannot_load(tmp_path):
    done = _self_test(tmp_path, "--model", str(tmp_path / "missing.gguf"), "--timeout", "120")
    assert done.returncode == 1
    assert "self-test: FAILED · the model did not load" in done.stderr and "missing.gguf" in done.stderr
    assert "<b>" not in done.stderr
