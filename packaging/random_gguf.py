"""A llama-architecture GGUF with random Q4_0 weights, for speed and cost curves where no real
model can travel (the GPU check machine takes 64 MiB of files and reaches no network).

    python packaging/random_gguf.py --vocab VOCAB.gguf --shape 8b --out /tmp/random-8b.gguf

The tokenizer (every ``tokenizer.*`` field) is copied from ``--vocab``, any GGUF with one, e.g.
llama.cpp's ``models/ggml-vocab-llama-bpe.gguf``. The weights are random Q4_0 blocks with one
small scale, so activations stay finite through every layer's RMS norm and the logits spread over
a few units: the output is gibberish, but a forward costs what a real model of that shape costs,
and two backends can be compared token by token (greedy on random weights has near-ties, so the
comparison reports the margin at a first difference). Acceptance rates of draft methods on such
a model mean nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

SHAPES = {  # n_embd, n_layer, n_head, n_head_kv, n_ff (Llama-3 8B and 1B, and a tiny one for tests)
    "8b": (4096, 32, 32, 8, 14336),
    "1b": (2048, 16, 32, 8, 8192),
    "tiny": (256, 2, 4, 2, 512),
}
Q4_0_BLOCK = 32  # values per block: an f16 scale and 16 bytes of 4-bit values


def q4_0(rows: int, cols: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    """Random Q4_0 data for a [rows, cols] matrix, as the bytes llama.cpp reads."""
    blocks = rng.integers(0, 256, size=(rows * cols // Q4_0_BLOCK, 18), dtype=np.uint8)
    blocks[:, :2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, cols // Q4_0_BLOCK * 18)


def write(vocab: Path, shape: str, out: Path, seed: int = 0) -> Path:
    import gguf

    n_embd, n_layer, n_head, n_kv, n_ff = SHAPES[shape]
    head_dim = n_embd // n_head
    source = gguf.GGUFReader(vocab)
    tokens = source.fields["tokenizer.ggml.tokens"]
    n_vocab = len(tokens.data)
    w = gguf.GGUFWriter(out, "llama")
    w.add_name(f"SpecDeck random {shape} (Q4_0, random weights)")
    w.add_context_length(8192)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            _copy_field(w, name, field)
    rng = np.random.default_rng(seed)
    scale = 0.5 / np.sqrt(n_embd)  # logits of a few units after the output layer
    q4 = gguf.GGMLQuantizationType.Q4_0
    ones = np.ones(n_embd, dtype=np.float32)
    w.add_tensor("token_embd.weight", q4_0(n_vocab, n_embd, rng, scale * 8), raw_dtype=q4)
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", q4_0(n_vocab, n_embd, rng, scale), raw_dtype=q4)
    for i in range(n_layer):
        for name, rows, cols in ((f"blk.{i}.attn_q.weight", n_embd, n_embd), (f"blk.{i}.attn_k.weight", n_kv * head_dim, n_embd),
                                 (f"blk.{i}.attn_v.weight", n_kv * head_dim, n_embd),
                                 (f"blk.{i}.attn_output.weight", n_embd, n_embd), (f"blk.{i}.ffn_gate.weight", n_ff, n_embd),
                                 (f"blk.{i}.ffn_up.weight", n_ff, n_embd), (f"blk.{i}.ffn_down.weight", n_embd, n_ff)):
            w.add_tensor(name, q4_0(rows, cols, rng, scale), raw_dtype=q4)
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _copy_field(w, name: str, field) -> None:
    """One tokenizer field, with its type, from a GGUFReader into a GGUFWriter."""
    import gguf

    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        sub = field.types[1]
        values = [field.parts[i] for i in field.data]
        if sub == gguf.GGUFValueType.STRING:
            values = [bytes(v).decode("utf-8", errors="surrogateescape") for v in values]
        else:
            values = [v.tolist()[0] for v in values]
        w.add_key_value(name, values, kind, sub_type=sub)
    elif kind == gguf.GGUFValueType.STRING:
        w.add_key_value(name, bytes(field.parts[field.data[0]]).decode("utf-8"), kind)
    else:
        w.add_key_value(name, field.parts[field.data[0]].tolist()[0], kind)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=Path, required=True, help="a GGUF whose tokenizer to copy")
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(write(args.vocab, args.shape, args.out, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
