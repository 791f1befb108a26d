"""EAGLE-3 heads published for a model (the EAGLE / SpecForge layout) read into a SpecDeck head.

Heads trained by SafeAILab's EAGLE or by SpecForge for a model come as a folder: ``config.json``
(``LlamaForCausalLMEagle3``: ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
``intermediate_size``, ``rms_norm_eps``, ``rope_theta``, ``vocab_size``, ``draft_vocab_size``, and
optionally ``eagle_aux_hidden_state_layer_ids`` and ``target_hidden_size``) and safetensors weights
(``fc``, ``midlayer.*`` for the one decoder layer, ``norm``, ``lm_head``, ``d2t``). Their arithmetic
is SpecDeck's EAGLE-3 layer (``backends.heads.eagle3``: the same norms, residual and RoPE layout), so
reading one is renaming: ``d2t`` holds offsets there (target id = draft id + ``d2t[id]``), absolute
ids here. A head read this way runs through both of SpecDeck's runners (numpy trees, and llama.cpp
after ``eagle3_gguf``), and is refused, with what differs, for a model it was not made for: the
vocabulary size, the width of the states it reads, and layers the model does not have. Pickled
weights (``pytorch_model.bin``) are refused: SpecDeck never unpickles. A config's ``rope_scaling``
(Llama 3's long-context frequencies) is not applied: output stays lossless, and guesses far into
a long context are accepted less often.

    head = read_published_eagle3("~/heads/EAGLE3-LLaMA3.1-Instruct-8B", "Llama-3.1-8B-Instruct-Q4_K_M.gguf")
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from backends.core.errors import HeadMismatchError, ModelFileError
from backends.heads.eagle3 import KIND, Eagle3Shape, default_layers
from backends.heads.files import HeadFile, ModelFingerprint

# the published name -> SpecDeck's (``Eagle3Shape.tensor_shapes``)
NAMES = {
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "embed_norm",
    "midlayer.hidden_norm.weight": "hidden_norm",
    "midlayer.self_attn.q_proj.weight": "q.weight",
    "midlayer.self_attn.k_proj.weight": "k.weight",
    "midlayer.self_attn.v_proj.weight": "v.weight",
    "midlayer.self_attn.o_proj.weight": "o.weight",
    "midlayer.post_attention_layernorm.weight": "ffn_norm",
    "midlayer.mlp.gate_proj.weight": "gate.weight",
    "midlayer.mlp.up_proj.weight": "up.weight",
    "midlayer.mlp.down_proj.weight": "down.weight",
    "norm.weight": "out_norm",
    "lm_head.weight": "lm.weight",
}


def is_published_eagle3(path: str | os.PathLike) -> bool:
    """A folder holding an EAGLE-3 head in the EAGLE / SpecForge layout."""
    folder = Path(path).expanduser()
    return folder.is_dir() and (folder / "config.json").is_file()


def _weights(folder: Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        raise ModelFileError(f"{folder} has no safetensors weights" + (
            f" ({', '.join(pickled)} are pickles, which SpecDeck never loads)" if pickled else ""))
    out: dict[str, np.ndarray] = {}
    for file in files:
        try:
            out.update(load_file(str(file)))
        except (OSError, SafetensorError) as exc:
            raise ModelFileError(f"the head weights {file} cannot be read ({exc})") from None
    return out


def head_shape(config: dict, target: ModelFingerprint, where: str) -> Eagle3Shape:
    """The head's shape from its config, checked against the target it is read for."""
    try:
        d, n_head = int(config["hidden_size"]), int(config["num_attention_heads"])
        layers = tuple(int(i) for i in config.get("eagle_aux_hidden_state_layer_ids") or default_layers(target.n_layer))
        shape = Eagle3Shape(d=d, n_head=n_head, n_kv_head=int(config.get("num_key_value_heads", n_head)),
                            head_dim=int(config.get("head_dim") or d // n_head), d_ff=int(config["intermediate_size"]),
                            draft_vocab=int(config.get("draft_vocab_size", config["vocab_size"])),
                            rope_theta=float(config.get("rope_theta", 10000.0)), eps=float(config.get("rms_norm_eps", 1e-6)),
                            layers=layers, target_d=int(config.get("target_hidden_size") or target.n_embd))
        vocab = int(config["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFileError(f"{where}: not an EAGLE-3 config ({exc!r} missing or wrong)") from None
    wrong = [f"{what} {mine} vs {theirs}" for what, mine, theirs in (
        ("vocabulary", vocab, target.n_vocab), ("width", shape.target_d, target.n_embd)) if mine != theirs]
    if any(not 0 <= il < target.n_layer for il in layers):
        wrong.append(f"layers {list(layers)} of a {target.n_layer}-layer model")
    if wrong:
        raise HeadMismatchError(f"{where} is an EAGLE-3 head for another model than {target.describe()} "
                                f"({'; '.join(wrong)})")
    return shape


def read_published_eagle3(folder: str | os.PathLike, target_gguf: str | os.PathLike) -> HeadFile:
    """The head in ``folder`` as a SpecDeck EAGLE-3 ``HeadFile`` for the model at ``target_gguf``."""
    folder = Path(folder).expanduser()
    target = ModelFingerprint.of(target_gguf)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{folder / 'config.json'} cannot be read ({exc})") from None
    shape = head_shape(config, target, str(folder))
    weights = _weights(folder)
    tensors: dict[str, np.ndarray] = {}
    for theirs, ours in NAMES.items():
        if theirs not in weights:
            raise ModelFileError(f"{folder}: the head has no tensor {theirs!r}")
        tensors[ours] = np.asarray(weights[theirs], np.float32).astype(np.float16)
    offsets = np.asarray(weights.get("d2t", np.zeros(shape.draft_vocab)), np.int64).reshape(-1)
    vocab = np.arange(len(offsets), dtype=np.int64) + offsets
    if len(vocab) != shape.draft_vocab or len(np.unique(vocab)) != len(vocab) or vocab.min() < 0 or vocab.max() >= target.n_vocab:
        raise ModelFileError(f"{folder}: its d2t does not map {shape.draft_vocab} draft tokens onto distinct target tokens")
    tensors["vocab"] = vocab
    for name, want in shape.tensor_shapes().items():
        if tensors[name].shape != want:
            raise ModelFileError(f"{folder}: tensor {name!r} is {tensors[name].shape}, its config says {want}")
    return HeadFile(KIND, shape.config(), target, tensors, {"published": str(folder)}, folder / "config.json")
