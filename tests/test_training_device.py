"""Head training on the device torch offers: a CUDA GPU where it sees one, else the CPU.

No test machine here has a GPU, so the step is checked on torch's ``meta`` device: tensors with a
shape and no data, which refuses to mix with a host tensor the way a GPU does ("Tensor on device
cpu is not on the expected device meta"). A recipe that made one tensor of its step on the host
(a causal mask, RoPE frequencies, a batch not moved) fails here as it would fail on a GPU: checked
by leaving out, one at a time, the device of the causal masks, of the RoPE frequencies, of the
input noise and of every batch (``OnDevice.tensor``); each made one to four kinds fail.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends.core.errors import SpecDeckError
from backends.heads.eagle import EagleShape
from backends.heads.eagle3 import Eagle3Shape
from backends.heads.mtp import MTPShape

torch = pytest.importorskip("torch", reason="training needs torch (installed by the test extra)")

VOCAB, WIDE, ROWS, USED = 32, 24, 16, 20
LAYERS = (0, 2, 3)


def _sequences(rng: np.random.Generator, n: int, width: int):
    """``n`` training sequences of ``ROWS`` rows whose states are ``width`` wide."""
    from backends.heads.eagle_training import Sequences

    return Sequences(states=rng.normal(size=(n, ROWS + 1, width)).astype(np.float16),
                     tokens=rng.integers(0, USED, size=(n, ROWS)),
                     positions=np.tile(np.arange(ROWS), (n, 1)),
                     valid=rng.random((n, ROWS)) < 0.9,
                     written=rng.integers(-1, VOCAB, size=(n, ROWS)),
                     held_out=np.arange(n) % 4 == 3,
                     table=rng.normal(size=(USED, WIDE)).astype(np.float32))


def _recipe(kind: str):
    """A recipe of ``kind`` on random data (what its step computes does not matter here)."""
    from backends.heads.eagle3_training import Eagle3Recipe, Eagle3TrainConfig
    from backends.heads.eagle_training import EagleRecipe, EagleTrainConfig
    from backends.heads.mtp_training import MTPRecipe, MTPTrainConfig
    from backends.heads.training import Examples, MedusaRecipe, MedusaTrainConfig

    rng = np.random.default_rng(0)
    vocab, lm = np.arange(VOCAB), rng.normal(size=(VOCAB, WIDE)).astype(np.float32)
    base = dict(d=WIDE, n_head=4, n_kv_head=2, head_dim=6, d_ff=32, draft_vocab=VOCAB)
    if kind == "medusa":
        examples = Examples(rng.normal(size=(64, WIDE)).astype(np.float16), rng.integers(-1, VOCAB, size=(64, 3)),
                            np.arange(64) % 8 == 7)
        return MedusaRecipe(examples, vocab, lm, MedusaTrainConfig(n_heads=3, draft_vocab=VOCAB, batch=8))
    if kind == "eagle":
        config = EagleTrainConfig(draft_vocab=VOCAB, batch=2, chunk=ROWS)
        return EagleRecipe(_sequences(rng, 8, WIDE), vocab, lm, EagleShape(**base), config)
    if kind == "eagle3":
        shape = Eagle3Shape(**base, layers=LAYERS, target_d=WIDE)
        config = Eagle3TrainConfig(draft_vocab=VOCAB, batch=2, chunk=ROWS, depth=3)
        return Eagle3Recipe(_sequences(rng, 8, (len(LAYERS) + 1) * WIDE), vocab, lm, shape, config)
    config = MTPTrainConfig(draft_vocab=VOCAB, batch=2, chunk=ROWS, depth=3)
    return MTPRecipe(_sequences(rng, 8, WIDE), vocab, lm, MTPShape(**base), config)


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3", "mtp"])
def test_a_training_step_makes_every_tensor_on_the_trainers_device(kind):
    """Loss and gradients of one step of each head kind, with the module on another device than
    the host: nothing of the step is made on the host (or it raises), and every gradient is there."""
    recipe = _recipe(kind)
    host_loss = recipe.loss(np.arange(2), step=3)
    assert host_loss.device.type == "cpu" and torch.isfinite(host_loss)
    recipe.place("meta")
    loss = recipe.loss(np.arange(2), step=3)
    loss.backward()
    assert loss.device.type == "meta" and loss.shape == host_loss.shape
    trained = [(name, p) for name, p in recipe.model.named_parameters() if p.requires_grad]
    assert trained and all(p.grad is not None and p.grad.device.type == "meta" for _, p in trained), \
        [name for name, p in trained if p.grad is None or p.grad.device.type != "meta"]


def test_the_training_device_is_a_gpu_only_where_torch_sees_one():
    """``auto`` takes a CUDA GPU where torch sees one; asking for one where it does not says why
    and what to do, before anything is recorded; a device of another name is refused."""
    from backends.heads.training import device_name, training_device
    from backends.train import TrainRequest, train

    assert training_device("cpu") == "cpu" and device_name("cpu") == "the CPU"
    with pytest.raises(SpecDeckError, match="device 'tpu'.*auto, cpu, cuda"):
        training_device("tpu")
    if torch.cuda.is_available():
        assert training_device("auto") == training_device("cuda") == "cuda"
        return
    assert training_device("auto") == "cpu"
    with pytest.raises(SpecDeckError, match="--device cuda: .*train with --device cpu") as refused:
        train(TrainRequest(kind="eagle", model="no-such-model.gguf", device="cuda"))
    assert "no-such-model" not in str(refused.value)  # refused before the model is even looked for
    build = "CPU-only build" if torch.version.cuda is None else "finds no usable NVIDIA GPU"
    assert build in str(refused.value)
