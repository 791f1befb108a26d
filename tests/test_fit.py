"""The memory-fit estimator: model shapes, terms checked against llama.cpp and the process, GPU plans."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from backends.core.errors import ModelFileError, SpecDeckError
from backends.drafters import method_spec
from backends.hardware.detect import detect_hardware
from backends.hardware.fit import (
    DOES_NOT_FIT,
    FITS_IN_VRAM,
    ON_CPU,
    Extra,
    MemoryTerm,
    RuntimeSettings,
    kv_layer_bytes,
    method_extra,
    output_buffer_bytes,
    plan,
    reserved_compute_bytes,
)
from backends.hardware.gpus import nvidia_gpus
from backends.hardware.memcheck import measure_growth
from backends.hardware.shape import load_shape
from backends.hardware.types import LlamaBuild, RamInfo
from backends.models.catalog import resolve_model
from backends.models.gguf_info import read_gguf_info
from tests.hw_replay import load_replay, recorded_cpu_machine

MiB = 1024**2
GiB = 1024**3
BUNDLED = ("smollm2-135m-q4_1", "gemma3-270m-q4_k_m")


@pytest.fixture(scope="module")
def shapes():
    return {m: load_shape(resolve_model(m)) for m in BUNDLED}


@pytest.fixture(scope="module")
def cpu_only():
    """A CPU-only machine (the recorded development VM), whatever GPU the machine running the tests has."""
    return recorded_cpu_machine()


@pytest.fixture
def rtx4090(cpu_only):
    """The recorded CPU machine with the recorded RTX 4090 and a CUDA build of llama.cpp."""
    gpus, _ = nvidia_gpus(load_replay("nvml_rtx4090.json"))
    build = LlamaBuild(version="0.3.36", backends=("CUDA", "CPU"), gpu_offload=True, system_info="CUDA : ARCHS = 890 |")
    return replace(cpu_only, gpus=gpus, llama_cpp=build)


def with_free_vram(hw, free_bytes: int):
    return replace(hw, gpus=tuple(replace(g, vram_free_bytes=free_bytes) for g in hw.gpus))


# -- shapes ------------------------------------------------------------------------------------
def test_gguf_shapes(shapes):
    smol, gemma = shapes["smollm2-135m-q4_1"], shapes["gemma3-270m-q4_k_m"]
    assert (smol.n_layer, smol.total_layers, smol.n_vocab, smol.head_kv[0]) == (30, 31, 49152, 3)
    assert smol.tied_output and smol.quantized and not any(smol.swa)
    # Gemma-3: every sixth layer attends globally, the others through a 512-token window.
    assert gemma.swa_window == 512 and sum(gemma.swa) == 15 and not gemma.swa[5] and not gemma.swa[17]
    for shape in (smol, gemma):
        assert shape.weights_bytes == read_gguf_info(shape.path).weights_bytes  # every tensor counted once


def test_kv_and_buffers_match_llama_cpp_log(shapes, caplog):
    """llama.cpp's own memory breakdown at context creation, against the estimator's terms."""
    from backends.llamacpp.model import LlamaModel
    from backends.llamacpp.target import LlamaTarget

    caplog.set_level(logging.DEBUG, logger="specdeck.llama")
    for model_id, n_ctx in (("smollm2-135m-q4_1", 1000), ("gemma3-270m-q4_k_m", 2048)):
        shape, rt = shapes[model_id], RuntimeSettings(n_ctx=n_ctx)
        caplog.clear()
        model = LlamaModel(shape.path)
        LlamaTarget(model, n_ctx=n_ctx).close()
        model.close()
        logged = {kind: [float(x) * MiB for x in re.findall(rf"CPU\s+{kind} buffer size =\s+([\d.]+) MiB", caplog.text)]
                  for kind in ("KV", "output", "compute")}
        kv = sum(kv_layer_bytes(shape, rt, i) for i in range(shape.n_layer))
        assert sum(logged["KV"]) == pytest.approx(kv, abs=0.01 * MiB)
        assert logged["output"][0] == pytest.approx(output_buffer_bytes(shape, rt), abs=0.01 * MiB)
        assert logged["compute"][0] == pytest.approx(reserved_compute_bytes(shape, rt, with_output=True), rel=0.02)


@pytest.mark.parametrize("model_id", BUNDLED)
@pytest.mark.parametrize("n_ctx", (512, 2048, 8192))
def test_estimate_matches_measured_process_growth(shapes, cpu_only, model_id, n_ctx):
    """A fresh process loads the model, prefills and verifies; its growth is within 15% of the estimate."""
    estimate = plan(shapes[model_id], cpu_only, RuntimeSettings(n_ctx=n_ctx)).total_bytes
    measured = measure_growth(shapes[model_id].path, n_ctx)
    assert abs(estimate - measured) <= 0.15 * measured, f"estimate {estimate / MiB:.1f} MiB, measured {measured / MiB:.1f} MiB"


# -- plans -------------------------------------------------------------------------------------
def test_cpu_only_machine_runs_on_cpu(shapes, cpu_only):
    report = plan(shapes["gemma3-270m-q4_k_m"], cpu_only, RuntimeSettings(n_ctx=8192))
    assert report.label == ON_CPU and report.fits and report.gpu_layers == 0 and report.max_gpu_layers == 0
    assert {t.device for t in report.terms} == {"cpu"}
    names = [t.name for t in report.terms]
    assert any(n.startswith("KV cache (f16, 8192") for n in names) and "weights: token embeddings" in names
    assert "weights: output layer (reads the token embeddings: its norm only)" in names  # tied: why it is so small


def test_not_enough_ram_does_not_fit(shapes, cpu_only):
    tiny = replace(cpu_only, ram=RamInfo(total_bytes=256 * MiB, available_bytes=100 * MiB))
    report = plan(shapes["gemma3-270m-q4_k_m"], tiny)
    assert report.label == DOES_NOT_FIT and not report.fits


def test_recorded_rtx4090_fits_everything_fixture(shapes, rtx4090):
    report = plan(shapes["gemma3-270m-q4_k_m"], rtx4090, RuntimeSettings(n_ctx=8192))
    assert report.label == FITS_IN_VRAM and report.gpu_layers == report.total_layers == 19
    gpu_terms = {t.name for t in report.terms if t.device == "gpu0"}
    assert "weights: output layer (copy of the tied embeddings)" in gpu_terms
    assert any(n.startswith("compute buffer (reserved") for n in gpu_terms)
    # The token embedding stays on the CPU, as llama.cpp keeps it.
    assert [t.device for t in report.terms if t.name == "weights: token embeddings"] == ["cpu"]
    data = report.to_json()
    assert {"label", "total_bytes", "gpu_layers", "terms"} <= set(data)
    assert data["terms"][0].keys() == {"name", "bytes", "device"}


def test_little_free_vram_gives_partial_offload_fixture(shapes, rtx4090):
    shape = shapes["smollm2-135m-q4_1"]
    full = plan(shape, rtx4090)
    need = full.device_bytes("gpu0")
    squeezed = with_free_vram(rtx4090, 1 * GiB + need - 40 * MiB)  # the 1 GiB margin plus 40 MiB short
    report = plan(shape, squeezed)
    assert 0 < report.gpu_layers < report.total_layers
    assert report.label == f"partial offload ({report.gpu_layers} of {report.total_layers} layers)"
    assert report.device_bytes("gpu0") <= report.available["gpu0"]
    more = plan(shape, squeezed, gpu_layers=report.gpu_layers + 1)  # one more layer is over the limit
    assert more.device_bytes("gpu0") > more.available["gpu0"] and not more.fits


def test_cpu_only_build_ignores_the_gpu_with_a_note_fixture(shapes, rtx4090):
    cpu_build = replace(rtx4090, llama_cpp=replace(rtx4090.llama_cpp, backends=("CPU",), gpu_offload=False))
    report = plan(shapes["smollm2-135m-q4_1"], cpu_build)
    assert report.label == ON_CPU and any("CPU-only build" in n for n in report.notes)


def test_draft_and_pool_terms(shapes, cpu_only):
    target = load_shape(resolve_model("smollm2-135m-f16"))
    alone = plan(target, cpu_only)
    pool = MemoryTerm("pld pool", 1_000_000, "cpu")
    both = plan(target, cpu_only, extra=Extra(draft=shapes["smollm2-135m-q4_1"], terms=(pool,)))
    draft_terms = [t for t in both.terms if t.name.startswith("draft ")]
    assert draft_terms and pool in both.terms
    assert both.total_bytes == alone.total_bytes + sum(t.bytes for t in draft_terms) + pool.bytes


def test_heads_follow_the_target_and_datastores_stay_in_ram_fixture(shapes, rtx4090, cpu_only):
    store = MemoryTerm("REST datastore (memory-mapped)", 300 * MiB, "cpu")
    extra = Extra(heads_bytes=50 * MiB, terms=(store,))
    on_gpu = plan(shapes["smollm2-135m-q4_1"], rtx4090, extra=extra)
    assert [t.device for t in on_gpu.terms if t.name.startswith("heads")] == ["gpu0"] and store in on_gpu.terms
    on_cpu = plan(shapes["smollm2-135m-q4_1"], cpu_only, extra=extra)
    assert [t.device for t in on_cpu.terms if t.name.startswith("heads")] == ["cpu"]


def test_context_is_capped_at_training_length(shapes, cpu_only):
    report = plan(shapes["smollm2-135m-q4_1"], cpu_only, RuntimeSettings(n_ctx=100_000))
    assert report.n_ctx == 8192 and any("training length" in n for n in report.notes)


def test_smaller_cache_types_shrink_the_kv_term(shapes):
    shape = shapes["smollm2-135m-q4_1"]
    sizes = [kv_layer_bytes(shape, RuntimeSettings(n_ctx=4096, cache_type=t), 0) for t in ("f16", "q8_0", "q4_0")]
    assert sizes[0] == 4096 * 3 * 128 * 2 and sizes[1] == sizes[0] * 34 // 64 and sizes[2] == sizes[0] * 18 // 64


@pytest.mark.parametrize("n_ctx", (0, -5, 1 << 30))
def test_absurd_context_is_a_clear_error(n_ctx):
    with pytest.raises(SpecDeckError, match="out of range"):
        RuntimeSettings(n_ctx=n_ctx)


# -- Hugging Face folders ------------------------------------------------------------------------
def write_hf_model(folder, *, layers=2, hidden=64, heads=4, kv_heads=2, vocab=1000, ff=128, tied=True, drop_layer=None):
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "vocab_size": vocab, "intermediate_size": ff, "torch_dtype": "float16",
              "max_position_embeddings": 2048, "tie_word_embeddings": tied}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {"model.embed_tokens.weight": np.zeros((vocab, hidden), np.float16),
               "model.norm.weight": np.zeros(hidden, np.float16)}
    for i in range(layers):
        if i == drop_layer:
            continue
        tensors[f"model.layers.{i}.self_attn.q_proj.weight"] = np.zeros((hidden, hidden), np.float16)
        tensors[f"model.layers.{i}.mlp.up_proj.weight"] = np.zeros((ff, hidden), np.float16)
    if not tied:
        tensors["lm_head.weight"] = np.zeros((vocab, hidden), np.float16)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_hf_safetensors_shape_and_plan(tmp_path, cpu_only):
    shape = load_shape(write_hf_model(tmp_path / "tiny", tied=False))
    assert shape.format == "safetensors" and shape.n_layer == 2 and not shape.tied_output
    assert shape.block_bytes == ((64 * 64 + 128 * 64) * 2,) * 2
    assert shape.embd_bytes == shape.output_bytes == 1000 * 64 * 2
    rt = RuntimeSettings(n_ctx=1024)
    assert kv_layer_bytes(shape, rt, 0) == 1024 * 2 * (16 + 16) * 2  # cells x kv heads x (k + v) x fp16
    report = plan(shape, cpu_only, rt)
    assert report.fits and any(t.name == "PyTorch runtime" for t in report.terms)


def test_hf_folder_missing_a_layer_is_refused(tmp_path):
    with pytest.raises(ModelFileError, match="missing the tensors of layer"):
        load_shape(write_hf_model(tmp_path / "broken", layers=3, drop_layer=1))


def test_pickle_only_folder_is_refused(tmp_path):
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
                                                   "vocab_size": 10}))
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ModelFileError, match="never loads pickled"):
        load_shape(folder)


def test_not_a_model_is_refused(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ModelFileError, match="neither a GGUF file nor"):
        load_shape(text)
    with pytest.raises(ModelFileError, match="does not exist"):
        load_shape(tmp_path / "missing.gguf")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ModelFileError, match="not valid JSON"):
        load_shape(tmp_path / "bad")


# -- command line ------------------------------------------------------------------------------
def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "backends.cli", *args], capture_output=True, text=True, timeout=300)


def test_specdeck_fit_json_and_text():
    """On the machine the tests run on: its own plan, on the CPU unless it has a GPU llama.cpp can use."""
    out = run_cli("fit", "smollm2-135m-q4_1", "--ctx", "2048", "--method", "pld", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    here = detect_hardware()
    expected = plan(load_shape(resolve_model("smollm2-135m-q4_1")), here, RuntimeSettings(n_ctx=2048),
                    method_extra(method_spec("pld"), 2048))
    assert (data["label"], data["gpu_layers"]) == (expected.label, expected.gpu_layers)
    usable_gpu = here.llama_cpp is not None and here.llama_cpp.gpu_offload and any(g.vram_total_bytes for g in here.gpus)
    if not usable_gpu:
        assert data["label"] == ON_CPU and data["gpu_layers"] == 0
    assert data["total_bytes"] == sum(t["bytes"] for t in data["terms"])
    assert any(t["name"] == "pld pool" for t in data["terms"])
    text = run_cli("fit", "smollm2-135m-q4_1", "--ctx", "2048")
    assert text.returncode == 0 and expected.label in text.stdout and "KV cache" in text.stdout
    assert text.stdout.startswith("smollm2-135m-q4_1 ")  # named as the user named it, not by its general.name


def test_specdeck_fit_bad_input(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    out = run_cli("fit", str(junk))
    assert out.returncode == 2 and "specdeck:" in out.stderr and "Traceback" not in out.stderr
    out = run_cli("fit", "smollm2-135m-q4_1", "--ctx", "999999999999")
    assert out.returncode == 2 and "out of range" in out.stderr
    out = run_cli("fit", "smollm2-135m-q4_1", "--method", "draft")
    assert out.returncode == 2 and "needs --draft-model" in out.stderr
    out = run_cli("fit", "smollm2-135m-q4_1", "--datastore", str(tmp_path / "missing.idx"))
    assert out.returncode == 2 and "cannot read" in out.stderr


def test_specdeck_fit_with_a_datastore_file(tmp_path):
    store = tmp_path / "notes.datastore"
    store.write_bytes(b"\0" * 123456)
    data = json.loads(run_cli("fit", "smollm2-135m-q4_1", "--datastore", str(store), "--json").stdout)
    assert {"name": "REST datastore (memory-mapped)", "bytes": 123456, "device": "cpu"} in data["terms"]


def test_gguf_missing_a_layer_is_refused(tmp_path):
    """A GGUF written by the gguf package whose header promises two blocks but holds one."""
    import gguf

    path = tmp_path / "half.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_context_length(64)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(16)])
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((8, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match=r"missing the tensors of layer\(s\) 1"):
        load_shape(path)
