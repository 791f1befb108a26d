"""API keys for servers, kept per server address: in the OS keyring when one is usable
(``keyring``, optional), else in a JSON file only its owner can read (mode 0600, created so, never
widened). Keys never go into settings files, logs or error messages.

Example: ``save_key("https://gpu-box:8000", "sk-...")`` then ``load_key("https://gpu-box:8000/v1/")``
gives the key back (the address is normalized: no trailing ``/`` or ``/v1``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from backends.models.paths import data_dir

_SERVICE = "specdeck"


def _normalize(url: str) -> str:
    url = url.strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def key_file() -> Path:
    return data_dir() / "server-keys.json"


def _keyring():
    """The keyring module when it has a real backend (not the "fail" or null ones), else None."""
    if os.environ.get("SPECDECK_NO_KEYRING"):
        return None
    try:
        import keyring
        from keyring.backends import fail
    except ImportError:
        return None
    backend = keyring.get_keyring()
    if isinstance(backend, fail.Keyring) or "null" in type(backend).__module__.lower() or backend.priority <= 0:
        return None
    return keyring


def _read_file() -> dict[str, str]:
    try:
        data = json.loads(key_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _write_file(keys: dict[str, str]) -> None:
    path = key_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # owner-only from the first byte
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(keys, f)
    os.replace(tmp, path)


def save_key(url: str, key: str | None) -> str:
    """Keep ``key`` for ``url`` (None or "" forgets it); returns where it went, in words."""
    url = _normalize(url)
    ring = _keyring()
    if ring is not None:
        if key:
            ring.set_password(_SERVICE, url, key)
        else:
            try:
                ring.delete_password(_SERVICE, url)
            except Exception:  # noqa: BLE001 - nothing was stored
                pass
        return "the system keyring"
    keys = _read_file()
    if key:
        keys[url] = key
    else:
        keys.pop(url, None)
    _write_file(keys)
    return f"{key_file()} (readable by you only)"


def load_key(url: str) -> str | None:
    """The key kept for ``url``, or None."""
    url = _normalize(url)
    ring = _keyring()
    if ring is not None:
        return ring.get_password(_SERVICE, url)
    return _read_file().get(url)
