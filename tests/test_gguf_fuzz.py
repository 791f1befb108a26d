"""Corrupt GGUF headers get one readable line: never a traceback, a hang or a huge allocation.

The mutations are made from the bundled model's own header (SmolLM2-135M Q4_1: 1.8 MB of
metadata and tensor table before 96 MB of weights). Each copies the header and changes one thing
that a flipped bit, a broken converter or a half-finished download changes: the version, the
tensor or key count, a key's length, a value type, a string's length, an array's item type or
count, a tensor's name length, dimension count, a dimension, its ggml type or data offset, a
few random bytes; or it cuts the file short inside the header. A file that is not cut keeps the
original's full size as a sparse file (the weights read as zeros from a hole), so the reader sees
what a real file has without 200 copies of 98 MB on disk.

The reference for where each field lies is the ``gguf`` package's own reader, run once on the
unchanged file. Everything is seeded: a failure names its mutation, and the same run repeats it.

Why: with ``gguf.GGUFReader`` as the reader, these 240 files gave 5 reads that ran on past 20 s
(one ended in MemoryError after 101 s under a 2 GiB cap), a UnicodeDecodeError traceback, 15
corrupt files taken as valid (a tensor's data offset moved, a dimension set to 0) and 219 errors
that quoted numpy ("index 0 is out of bounds for axis 0 with size 0").
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from backends.core.errors import ModelFileError
from backends.models.catalog import resolve_model
from backends.models.gguf_info import read_gguf_info

SEED = 16
N_FIELD_MUTATIONS = 200
N_CUTS = 20
N_SPLATS = 20
N_CLI = 20
READ_LIMIT_S = 10.0  # the intact header reads in about 0.2 s
MEMORY_HEADROOM = 1 << 30  # the reader may allocate up to 1 GiB beyond what the test process holds


@dataclass(frozen=True)
class Slot:
    """One integer field of the intact header: where it is, how wide, what it holds, what it is."""

    label: str
    offset: int
    width: int  # 4 or 8 bytes
    value: int
    kind: str  # version | count | length | type | n_dims | dim | ggml_type | tensor_offset


@dataclass(frozen=True)
class Mutation:
    label: str
    kind: str
    edits: tuple[tuple[int, bytes], ...] = ()
    cut: int | None = None  # the file ends here (inside the header) instead of at full size


@dataclass(frozen=True)
class Layout:
    path: Path
    header: bytes  # everything before the tensor data
    file_size: int
    slots: tuple[Slot, ...]


@pytest.fixture(scope="module")
def layout() -> Layout:
    return read_layout(resolve_model("smollm2-135m-q4_1"))


def read_layout(path: Path) -> Layout:
    """Every field worth mutating, located with ``gguf.GGUFReader`` on the intact file."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    base = reader.data.ctypes.data

    def at(part) -> int:
        return int(part.ctypes.data) - base

    slots = [Slot("version", 4, 4, 3, "version"), Slot("tensor count", 8, 8, len(reader.tensors), "count"),
             Slot("key count", 16, 8, int(reader.fields["GGUF.kv_count"].parts[0][0]), "count")]
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        parts = field.parts
        slots += [Slot(f"{name}: key length", at(parts[0]), 8, int(parts[0][0]), "length"),
                  Slot(f"{name}: value type", at(parts[2]), 4, int(parts[2][0]), "type")]
        if len(field.types) == 1 and field.types[0] == 8:  # a string
            slots.append(Slot(f"{name}: string length", at(parts[3]), 8, int(parts[3][0]), "length"))
        if field.types[0] == 9:  # an array: item type, count, and for strings two items' lengths
            slots += [Slot(f"{name}: item type", at(parts[3]), 4, int(parts[3][0]), "type"),
                      Slot(f"{name}: item count", at(parts[4]), 8, int(parts[4][0]), "count")]
            if field.types[-1] == 8:
                for item in sorted({0, min(1000, len(field.data) - 1)}):
                    length = parts[5 + 2 * item]
                    slots.append(Slot(f"{name}: item {item} length", at(length), 8, int(length[0]), "length"))
    picked = sorted(random.Random(SEED).sample(range(1, len(reader.tensors) - 1), 18) + [0, len(reader.tensors) - 1])
    for i in picked:
        tensor = reader.tensors[i]
        name_len, _name, n_dims, dims, ggml_type, offset = tensor.field.parts
        slots += [Slot(f"{tensor.name}: name length", at(name_len), 8, int(name_len[0]), "length"),
                  Slot(f"{tensor.name}: dimension count", at(n_dims), 4, int(n_dims[0]), "n_dims"),
                  Slot(f"{tensor.name}: dimension 0", at(dims), 8, int(dims[0]), "dim"),
                  Slot(f"{tensor.name}: ggml type", at(ggml_type), 4, int(ggml_type[0]), "ggml_type"),
                  Slot(f"{tensor.name}: data offset", at(offset), 8, int(offset[0]), "tensor_offset")]
    with open(path, "rb") as f:
        header = f.read(reader.data_offset)
    return Layout(path=path, header=header, file_size=path.stat().st_size, slots=tuple(slots))


def candidates(slot: Slot, rng: random.Random) -> list[int]:
    """Values a corrupt file could hold in ``slot``: edge values, near misses and noise."""
    v, top = slot.value, 2 ** (8 * slot.width) - 1
    by_kind = {
        "version": [0, 1, 4, 0x03000000, top],
        "count": [0, v + 1, 2 * v + 1, 2**31, top // 2 + 1, top, rng.getrandbits(8 * slot.width)],
        "length": [0, v + 1, max(v - 1, 0), 2**31, 2**32 - 1, 2**63, top, rng.getrandbits(8 * slot.width)],
        "type": [7 if v != 7 else 0, 8, 9, 10 if v != 10 else 4, 13, 255, top],  # resized, string, array, invalid
        "n_dims": [0, v + 1, 5, top],
        "dim": [0, v + 1, 2**40, 2**63, top],
        "ggml_type": [0 if v else 1, 4, 5, 31, 43, 99, top],  # another real type, removed ones, beyond the last
        "tensor_offset": [v + 1, v + 32, max(v - 32, 0) if v else 32, 2**63, top],
    }
    return [x & top for x in by_kind[slot.kind] if (x & top) != v]


def make_mutations(layout: Layout) -> list[Mutation]:
    rng = random.Random(SEED)
    pool = [(slot, value) for slot in layout.slots for value in candidates(slot, rng)]
    out = [Mutation(f"{slot.label} {slot.value:,} -> {value:,}", slot.kind,
                    edits=((slot.offset, value.to_bytes(slot.width, "little")),))
           for slot, value in rng.sample(pool, N_FIELD_MUTATIONS)]
    header = len(layout.header)
    for cut in sorted(rng.sample(range(5, 4096), N_CUTS // 2) + rng.sample(range(4096, header), N_CUTS - N_CUTS // 2)):
        out.append(Mutation(f"cut at byte {cut:,}", "cut", cut=cut))
    for _ in range(N_SPLATS):
        offset, n = rng.randrange(4, 4096), rng.randint(1, 4)
        noise = bytes(rng.getrandbits(8) for _ in range(n))
        out.append(Mutation(f"bytes {offset:,}..{offset + n - 1:,} -> {noise.hex()}", "splat", edits=((offset, noise),)))
    return out


def write_mutation(layout: Layout, mutation: Mutation, path: Path) -> Path:
    data = bytearray(layout.header)
    for offset, raw in mutation.edits:
        data[offset:offset + len(raw)] = raw
    with open(path, "wb") as f:
        f.write(data[:mutation.cut] if mutation.cut is not None else data)
        if mutation.cut is None:
            f.truncate(layout.file_size)  # the weights: a hole, not 96 MB of zeros on disk
    return path


class Hung(BaseException):
    """Raised by the alarm when one read runs past READ_LIMIT_S (BaseException: no except can swallow it)."""


@contextmanager
def time_limit(seconds: float):
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield  # Windows, or not the main thread: the elapsed time is still checked afterwards
        return

    def on_alarm(_signum, _frame):
        raise Hung()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def memory_cap(headroom: int):
    """Cap this process's data segment at what it holds now plus ``headroom`` (Linux): a read that
    tries to allocate gigabytes fails with MemoryError, which the test counts as a crash."""
    try:
        import resource

        status = Path("/proc/self/status").read_text()
    except (ImportError, OSError):
        yield
        return
    vm_data = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmData:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = vm_data + headroom if hard == resource.RLIM_INFINITY else min(hard, vm_data + headroom)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def outcome(path: Path) -> tuple[str, str, float]:
    """("error", message) for a ModelFileError, ("read", "") when the file still reads, or the
    crash: ("hang", "") or ("crash", "TypeName: message"); and the seconds it took."""
    start = time.perf_counter()
    try:
        with time_limit(READ_LIMIT_S):
            read_gguf_info(path, use_cache=False)
        result = ("read", "")
    except ModelFileError as exc:
        result = ("error", str(exc))
    except Hung:
        result = ("hang", "")
    except Exception as exc:  # noqa: BLE001 - the test classifies whatever escapes the reader
        result = ("crash", f"{type(exc).__name__}: {exc}"[:300])
    return (*result, time.perf_counter() - start)


def test_200_corrupt_headers_each_give_one_readable_line(layout, tmp_path):
    mutations = make_mutations(layout)
    assert len(mutations) >= 200
    results: dict[Mutation, tuple[str, str, float]] = {}
    with memory_cap(MEMORY_HEADROOM):
        for i, mutation in enumerate(mutations):
            path = write_mutation(layout, mutation, tmp_path / f"m{i:03d}.gguf")
            results[mutation] = outcome(path)
            path.unlink()
    crashes = [f"{m.label}: {kind} {text}" for m, (kind, text, _) in results.items() if kind in ("crash", "hang")]
    assert crashes == [], f"{len(crashes)} of {len(mutations)} mutations crashed the reader:\n" + "\n".join(crashes)
    slow = [f"{m.label}: {s:.1f} s" for m, (_, _, s) in results.items() if s > READ_LIMIT_S]
    assert slow == []
    errors = {m: text for m, (kind, text, _) in results.items() if kind == "error"}
    for m, text in errors.items():
        assert "\n" not in text and len(text) < 400, f"{m.label}: not one short line: {text!r}"
        assert text.startswith(str(tmp_path.resolve())), f"{m.label}: the message does not name the file: {text!r}"
    assert all(m in errors for m in mutations if m.kind == "cut")  # a cut inside the header is never a model
    # Changed counts, lengths, types and offsets leave a header that cannot be walked; only edits that
    # still describe a valid file (another same-size type, a renamed key) read through.
    structural = [m for m in mutations if m.kind not in ("splat", "cut")]
    assert sum(m in errors for m in structural) >= 0.9 * len(structural)


def test_corrupt_headers_through_the_real_command_line(layout, tmp_path):
    """``specdeck models info`` on a sample: exit 2, the reader's one line on stderr, no traceback."""
    rng = random.Random(SEED + 1)
    by_kind: dict[str, list[Mutation]] = {}
    for mutation in make_mutations(layout):
        by_kind.setdefault(mutation.kind, []).append(mutation)
    sample = [rng.choice(ms) for ms in by_kind.values()]  # every kind of damage at least once
    rest = [m for ms in by_kind.values() for m in ms if m not in sample]
    sample += rng.sample(rest, N_CLI - len(sample))
    env = {**os.environ, "SPECDECK_CACHE_DIR": str(tmp_path / "cache")}
    checked = 0
    for i, mutation in enumerate(sample):
        path = write_mutation(layout, mutation, tmp_path / f"cli{i:02d}.gguf")
        kind, message, _ = outcome(path)
        if kind != "error":  # this damage left a valid header; the in-process test covers crashes
            continue
        out = subprocess.run([sys.executable, "-m", "backends.cli", "models", "info", str(path)],
                             capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 2, f"{mutation.label}: exit {out.returncode}\n{out.stderr}"
        assert out.stderr.splitlines() == [f"specdeck: {message}"], f"{mutation.label}: {out.stderr!r}"
        assert out.stdout == "" and "Traceback" not in out.stderr
        checked += 1
        path.unlink()
    assert checked >= N_CLI - 2


# -- headers that are well formed but say impossible things --------------------------------------
def tiny_gguf(path: Path, architecture: str = "llama", *, edit=None) -> Path:
    """A small, valid GGUF written by the gguf package: two tensors, a 16-token vocabulary."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(16)])
    if edit:
        edit(writer)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    writer.add_tensor("output_norm.weight", np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_gguf_reads(tmp_path):
    info = read_gguf_info(tiny_gguf(tmp_path / "tiny.gguf"), use_cache=False)
    assert (info.architecture, info.n_layer, info.n_embd, info.vocab.n_vocab) == ("llama", 1, 8, 16)
    assert [(t.name, t.shape, t.ggml_type) for t in info.tensors] == [("token_embd.weight", (8, 16), "F32"),
                                                                     ("output_norm.weight", (8,), "F32")]


def test_the_pytorch_loader_names_a_size_the_header_lacks(tmp_path):
    """The PyTorch backend builds the model from the header's sizes: one missing (this file has no
    feed-forward length) is a clear refusal naming the key, not a TypeError. (A size that is not a
    number is refused by the header reader before, as for llama.cpp.)"""
    from backends.pytorch.weights import read_gguf

    with pytest.raises(ModelFileError, match="no usable llama.feed_forward_length"):
        read_gguf(tiny_gguf(tmp_path / "no_ffn.gguf"))


@pytest.mark.parametrize("edit, needle", [
    (lambda w: w.add_uint32("general.alignment", 24), "not a power of two"),
    (lambda w: w.add_uint64("general.alignment", 32), "must be uint32"),
    (lambda w: w.add_string("llama.block_count", "thirty"), "should hold an integer"),
    (lambda w: w.add_array("tokenizer.ggml.tokens", [1, 2, 3]), "should hold a list of text"),
])
def test_well_formed_headers_that_say_wrong_things(tmp_path, edit, needle):
    path = tiny_gguf(tmp_path / "odd.gguf", edit=edit)
    with pytest.raises(ModelFileError, match=needle) as err:
        read_gguf_info(path, use_cache=False)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("old, new, needle", [
    (b"general.architecture", b"general.architectur_", "names no model architecture"),
    (b"general.architectur2", b"general.architecture", "'general.architecture' appears twice"),
    (b"token_embd.weigh2", b"token_embd.weight", "tensor 'token_embd.weight' appears twice"),
    (b"output_norm.weight", b"output_norm\0weight", "contains a NUL byte"),
])
def test_renamed_keys_and_tensors(tmp_path, old, new, needle):
    """Same-length renames keep the header well formed; what they say is still refused."""
    def extra(writer):
        writer.add_uint32("general.architectur2", 1)
        writer.add_tensor("token_embd.weigh2", np.zeros(8, np.float32))

    path = tiny_gguf(tmp_path / "renamed.gguf", edit=extra)
    data = path.read_bytes()
    assert data.count(old) == 1
    path.write_bytes(data.replace(old, new))
    with pytest.raises(ModelFileError, match=needle):
        read_gguf_info(path, use_cache=False)


def test_a_model_of_an_architecture_llama_cpp_does_not_know(tmp_path):
    """The header reads (the architecture is only a name to it); llama.cpp's loader and
    ``specdeck models info`` both say which architecture it is and that llama.cpp does not know it."""
    from backends.llamacpp.model import LlamaModel

    path = tiny_gguf(tmp_path / "strange.gguf", "notanarch")
    assert read_gguf_info(path, use_cache=False).architecture == "notanarch"
    with pytest.raises(ModelFileError, match="unknown model architecture: 'notanarch'") as err:
        LlamaModel(path)
    assert "\n" not in str(err.value)
    out = subprocess.run([sys.executable, "-m", "backends.cli", "models", "info", str(path)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "SPECDECK_CACHE_DIR": str(tmp_path / "cache")})
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith("specdeck: ") and "unknown model architecture: 'notanarch'" in line

