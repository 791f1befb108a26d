"""A tiny GGUF with a native MTP (next-n) layer, written with the ``gguf`` package for the tests.

No small model with MTP layers exists offline, so the tests make one: llama.cpp's ``hy_v3``
architecture (the simplest dense one whose graph runs its next-n block in an MTP context), two
trunk blocks and one next-n block of width 64, random weights, and the bundled SmolLM2's
tokenizer so any text tokenizes. With random weights the MTP guesses are mostly wrong (the
rollback path). ``copy=True`` zeroes every attention and feed-forward weight and makes the
next-n block's input projection pass the token's embedding through: model and block then both
compute ``argmax_v e_v . norm(e_x)`` of the last token ``x``, so the block's every guess is the
model's next token (the all-accepted path).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

E, HEADS, KV_HEADS, FF, TRUNK, NEXTN = 64, 4, 2, 128, 2, 1


@lru_cache(maxsize=2)
def _tokenizer(source: Path) -> dict[str, list]:
    import gguf

    reader = gguf.GGUFReader(str(source))

    def strings(key: str) -> list[str]:
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    def ints(key: str) -> list[int]:
        field = reader.fields[key]
        return [int(field.parts[i][0]) for i in field.data]

    return {"tokens": strings("tokenizer.ggml.tokens"), "merges": strings("tokenizer.ggml.merges"),
            "types": ints("tokenizer.ggml.token_type"), "eos": ints("tokenizer.ggml.eos_token_id")[0],
            "bos": ints("tokenizer.ggml.bos_token_id")[0]}


def write_mtp_gguf(path: Path, tokenizer_source: Path, *, copy: bool = False, seed: int = 0,
                   nextn: int = NEXTN, context: int = 512) -> Path:
    """Write the tiny model to ``path`` (``nextn=0``: the same trunk without a next-n block;
    ``context``: its trained context, 4096 for Spec-Bench's longest questions)."""
    import gguf

    tok = _tokenizer(tokenizer_source)
    n_vocab, head_dim = len(tok["tokens"]), E // HEADS
    rng = np.random.default_rng(seed)

    def random(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    def weight(*shape: int) -> np.ndarray:
        return np.zeros(shape, np.float32) if copy else random(*shape)

    def norm(n: int, value: float = 1.0) -> np.ndarray:
        return np.full(n, value, np.float32)

    w = gguf.GGUFWriter(str(path), "hy_v3")
    w.add_name("tiny-mtp")
    w.add_context_length(context)
    w.add_embedding_length(E)
    w.add_block_count(TRUNK + nextn)
    if nextn:
        w.add_nextn_predict_layers(nextn)
    w.add_feed_forward_length(FF)
    w.add_expert_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tok["tokens"])
    w.add_token_merges(tok["merges"])
    w.add_token_types(tok["types"])
    w.add_bos_token_id(tok["bos"])
    w.add_eos_token_id(tok["eos"])
    w.add_tensor("token_embd.weight", random(n_vocab, E).astype(np.float16))
    w.add_tensor("output_norm.weight", norm(E))
    for i in range(TRUNK + nextn):
        p = f"blk.{i}."
        for name, array in (("attn_norm", norm(E)), ("attn_q", weight(HEADS * head_dim, E)),
                            ("attn_k", weight(KV_HEADS * head_dim, E)), ("attn_v", weight(KV_HEADS * head_dim, E)),
                            ("attn_output", weight(E, HEADS * head_dim)), ("attn_q_norm", norm(head_dim)),
                            ("attn_k_norm", norm(head_dim)), ("ffn_norm", norm(E)), ("ffn_gate", weight(FF, E)),
                            ("ffn_up", weight(FF, E)), ("ffn_down", weight(E, FF))):
            w.add_tensor(p + name + ".weight", array)
        if i >= TRUNK:
            # [E, 2E] over concat(norm(embedding), norm(state)): the embedding alone when copying
            w.add_tensor(p + "nextn.eh_proj.weight", np.eye(E, 2 * E, dtype=np.float32) if copy else random(E, 2 * E))
            w.add_tensor(p + "nextn.enorm.weight", norm(E))
            w.add_tensor(p + "nextn.hnorm.weight", norm(E))
            w.add_tensor(p + "nextn.shared_head_norm.weight", norm(E))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
