"""An EAGLE-3 head as a GGUF of llama.cpp's ``eagle3`` architecture (written with the ``gguf`` package).

Why: a head that llama.cpp runs (``backends.llamacpp.eagle3``) gets llama.cpp's kernels and, where
the target sits on a GPU, the GPU; numpy runs it on the CPU only. SpecDeck's EAGLE-3 arithmetic
is llama.cpp's (``backends.heads.eagle3``), so exporting is renaming plus two layout changes:

- RoPE: SpecDeck rotates the two halves of each head (``x[:hd/2]`` with ``x[hd/2:]``), llama.cpp's
  ``eagle3`` graph rotates adjacent pairs (``LLAMA_ROPE_TYPE_NORM``), so the rows of ``W_q`` and
  ``W_k`` are permuted within each head: rows ``(i, hd/2 + i)`` become ``(2i, 2i + 1)``. Queries
  and keys are permuted alike, so every score is unchanged.
- The draft vocabulary: ``vocab`` (target ids) is llama.cpp's ``d2t`` (I64, absolute ids); the
  graph scatters the ``V'`` logits into a full-vocabulary row, ``-inf`` elsewhere.

The file holds no token embeddings and no tokenizer of its own weights' making: llama.cpp reads
the embeddings from the target's context (``ctx_other``), and the tokenizer keys are copied from
the target's GGUF (llama.cpp loads a vocabulary with every model). For SmolLM2 the file is 12 MB.

    head = HeadFile.load("smollm2-135m-f16.eagle3.json")
    export_eagle3_gguf(head, "smollm2-135m-f16.gguf", "smollm2-135m-f16.eagle3.gguf")
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from backends.core.errors import ModelFileError
from backends.heads.eagle3 import KIND, Eagle3Shape
from backends.heads.files import HeadFile, ModelFingerprint
from backends.models.paths import cache_dir, keep_recent, mark_used

ARCH = "eagle3"
FUSED_LAYERS = 3  # llama.cpp's eagle3 graph fuses exactly three target layers

# SpecDeck's tensor name -> llama.cpp's (src/llama-arch.cpp's names for LLM_ARCH_EAGLE3)
TENSOR_NAMES = {
    "fc.weight": "fc.weight",
    "embed_norm": "blk.0.attn_norm.weight",
    "hidden_norm": "blk.0.attn_norm_2.weight",
    "q.weight": "blk.0.attn_q.weight",
    "k.weight": "blk.0.attn_k.weight",
    "v.weight": "blk.0.attn_v.weight",
    "o.weight": "blk.0.attn_output.weight",
    "ffn_norm": "blk.0.ffn_norm.weight",
    "gate.weight": "blk.0.ffn_gate.weight",
    "up.weight": "blk.0.ffn_up.weight",
    "down.weight": "blk.0.ffn_down.weight",
    "out_norm": "output_norm.weight",
    "lm.weight": "output.weight",
}


def halves_to_pairs(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a query or key projection [n_head * hd, in] from the halves RoPE layout to the
    adjacent-pairs one: within each head, row ``i`` goes to ``2i`` and row ``hd/2 + i`` to ``2i + 1``."""
    rows, cols = w.shape
    hd = rows // n_head
    return w.reshape(n_head, 2, hd // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _tokenizer_fields(target_gguf: Path):
    """(name, value, types) of the target's ``tokenizer.*`` keys, as the gguf reader gives them."""
    import gguf

    reader = gguf.GGUFReader(str(target_gguf))
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            yield name, field.contents(), field.types


def _write_field(writer, name: str, value, types) -> None:
    import gguf

    if types[0] == gguf.GGUFValueType.ARRAY:
        writer.add_array(name, value)
    elif types[0] == gguf.GGUFValueType.STRING:
        writer.add_string(name, value)
    elif types[0] == gguf.GGUFValueType.BOOL:
        writer.add_bool(name, bool(value))
    else:
        writer.add_key_value(name, value, types[0])


def export_eagle3_gguf(head: HeadFile, target_gguf: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write ``head`` (an EAGLE-3 ``HeadFile``) as an ``eagle3`` GGUF for the target at
    ``target_gguf``; returns ``out``. Refused, with the reason, for another model's head or a head
    llama.cpp's graph cannot run (not three fused layers)."""
    import gguf

    target_gguf, out = Path(target_gguf), Path(out)
    if head.kind != KIND:
        raise ModelFileError(f"{head.path or 'the head'} is a {head.kind} head; only EAGLE-3 heads export to llama.cpp")
    head.check_for(ModelFingerprint.of(target_gguf), KIND)
    s = Eagle3Shape.from_config(head.config, str(head.path))
    if len(s.layers) != FUSED_LAYERS:
        raise ModelFileError(f"llama.cpp's eagle3 graph fuses {FUSED_LAYERS} target layers; this head fuses {len(s.layers)}")
    tensors = {name: head.tensor(name, shape) for name, shape in s.tensor_shapes().items()}
    tensors["q.weight"] = halves_to_pairs(tensors["q.weight"], s.n_head)
    tensors["k.weight"] = halves_to_pairs(tensors["k.weight"], s.n_kv_head)
    vocab = np.asarray(head.tensors["vocab"], np.int64)
    if vocab.shape != (s.draft_vocab,) or len(np.unique(vocab)) != len(vocab):
        raise ModelFileError(f"{head.path or 'the head'}: its draft vocabulary is not {s.draft_vocab} distinct ids")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), ARCH)
    writer.add_name(f"EAGLE-3 head for {head.target.name}")
    writer.add_block_count(1)
    writer.add_context_length(1 << 16)
    writer.add_embedding_length(s.d)
    writer.add_feed_forward_length(s.d_ff)
    writer.add_head_count(s.n_head)
    writer.add_head_count_kv(s.n_kv_head)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_rope_dimension_count(s.head_dim)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_layer_norm_rms_eps(s.eps)
    writer.add_vocab_size(head.target.n_vocab)
    writer.add_array(f"{ARCH}.target_layers", [int(i) for i in s.layers])
    writer.add_uint32(f"{ARCH}.target_hidden_size", s.target_d)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for name, value, types in _tokenizer_fields(target_gguf):
        _write_field(writer, name, value, types)
    for name, value in tensors.items():
        matrix = value.ndim == 2
        writer.add_tensor(TENSOR_NAMES[name], value.astype(np.float16 if matrix else np.float32))
    writer.add_tensor("d2t", vocab, raw_dtype=gguf.GGMLQuantizationType.I64)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
    return out


KEPT_EXPORTS = 8  # exported heads the cache keeps (10-20 MB each for a small model), the most recently used


def exported_gguf(head: HeadFile, target_gguf: str | os.PathLike) -> Path:
    """``head`` as an ``eagle3`` GGUF in the cache folder, written once per head and target (the
    name is a digest of both, so a retrained head is exported anew)."""
    import hashlib

    digest = hashlib.sha256(str(Path(target_gguf).resolve()).encode())
    for name in sorted(head.tensors):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(head.tensors[name]).tobytes())
    out = cache_dir() / "heads" / f"{Path(target_gguf).stem}.eagle3-{digest.hexdigest()[:16]}.gguf"
    if out.exists():
        mark_used(out)
        return out
    export_eagle3_gguf(head, target_gguf, out)
    keep_recent(out.parent, KEPT_EXPORTS, "*.gguf", spare=out)
    return out
