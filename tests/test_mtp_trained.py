"""A DeepSeek-V3-style MTP module trained for a model without one (``specdeck train mtp``).

Oracle tier: the numpy module equals its torch twin along a recursive chain; trained by the real
recipe on the oracle's own answers it learns, and the EAGLE-2 drafter running it writes exactly
what plain decoding writes (chains and trees, a repetition penalty). Real tier: `specdeck train
mtp` on SmolLM2 writes a module that drafts in a session with output equal to `ar` (or parting
from it only at a measured near-tie).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from backends.core.engine import generate
from backends.core.types import GenerationSettings, SamplingSettings
from backends.drafters.eagle import EagleDrafter, EagleSettings
from backends.heads.files import HeadFile, ModelFingerprint
from backends.heads.mtp import KIND, MTPModuleHead, MTPShape
from tests.oracle import OracleTarget
from tests.test_engine import COSTS, plain_greedy
from tests.test_heads import oracle_prompt, record_oracle
from tests.test_real_models import answer, same_or_near_tie

VOCAB, WIDE = 32, 24
FAKE_MODEL = ModelFingerprint("oracle", "oracle", "F32", 1, WIDE, VOCAB, "0" * 16)
SHAPE = MTPShape(d=WIDE, n_head=4, n_kv_head=2, head_dim=6, d_ff=32, draft_vocab=VOCAB)
TABLE = np.random.default_rng(11).normal(size=(VOCAB, WIDE)).astype(np.float32)


def embed(tokens: np.ndarray) -> np.ndarray:
    return TABLE[np.asarray(tokens)]


def test_numpy_module_equals_its_torch_twin_along_a_recursive_chain():
    torch = pytest.importorskip("torch", reason="training needs torch (installed by the test extra)")
    from backends.heads.mtp_training import mtp_module

    torch.manual_seed(0)
    model = mtp_module(torch, SHAPE, np.random.default_rng(0).normal(size=(VOCAB, WIDE)).astype(np.float32))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
            p.copy_(p.half().float())
    tensors = {("lm.weight" if k == "lm" else k): v.numpy().astype(np.float16) for k, v in model.state_dict().items()}
    tensors["vocab"] = np.arange(VOCAB, dtype=np.int64)
    head = MTPModuleHead(HeadFile(KIND, SHAPE.config(), FAKE_MODEL, tensors, {}), embed)
    rng = np.random.default_rng(1)
    L = 12
    states = rng.normal(size=(L, WIDE)).astype(np.float32)
    tokens = rng.integers(0, VOCAB, size=L)
    positions = np.arange(L)
    with torch.no_grad():
        preds = model.chain(torch.from_numpy(embed(tokens))[None], torch.from_numpy(states)[None],
                            torch.from_numpy(positions)[None], 3)
        logits = model.logits(preds[0])[0].log_softmax(-1).numpy()
    cache = head.new_cache()
    ours = head.forward(states, tokens, positions, cache, np.tril(np.ones((L, L), bool)))
    np.testing.assert_allclose(ours, preds[0][0].numpy(), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(head.log_probs(ours), logits, rtol=1e-3, atol=1e-2)  # logits reach 25
    assert ours.dtype == head.log_probs(ours).dtype == np.float32  # float64 made every product convert the weights
    cache.commit()
    t = L - 4
    cache = head.new_cache()
    head.forward(states[: t + 1], tokens[: t + 1], positions[: t + 1], cache, np.tril(np.ones((t + 1,) * 2, bool)))
    cache.commit()
    state = ours[t]
    for level in (1, 2):  # applied recursively: its own output, the next true token
        state = head.forward(state[None], tokens[t + level: t + level + 1], positions[t:t + 1] + level, cache,
                             np.ones((1, level), bool))[0]
        np.testing.assert_allclose(state, preds[level][0, t].numpy(), rtol=1e-3, atol=1e-3)


@pytest.fixture(scope="module")
def oracle_mtp(tmp_path_factory) -> HeadFile:
    """A module trained with torch on the oracle's own answers (the real recipe)."""
    pytest.importorskip("torch")
    from backends.heads.eagle_training import eagle_sequences
    from backends.heads.mtp_training import MTPTrainConfig, MTPTrainer
    from backends.heads.training import draft_vocabulary

    oracle = OracleTarget(VOCAB, seed=7, hidden_size=WIDE)
    rng = np.random.default_rng(0)
    samples = record_oracle(oracle, [rng.integers(0, VOCAB, size=12).tolist() for _ in range(60)], 40)
    config = MTPTrainConfig(draft_vocab=VOCAB, lr=1e-2, batch=8, chunk=48, depth=3, eval_every=40, max_epochs=60,
                            precision="float32")  # the same instrument on every PC
    vocab = draft_vocabulary([s for _, s in samples], VOCAB, [], VOCAB)
    data = eagle_sequences(samples, vocab, VOCAB, config.chunk, embed)
    lm = (np.random.default_rng(5).normal(size=(VOCAB, WIDE)) * 0.3).astype(np.float32)
    trainer = MTPTrainer(data, vocab, lm, SHAPE, FAKE_MODEL, config, tmp_path_factory.mktemp("mtp") / "m.safetensors",
                         device="cpu")
    before = trainer.agreement()
    result = trainer.run(200)
    assert result.agreement[0] > max(3 / VOCAB, before[0] + 0.1), f"step 1 learned little: {before} -> {result.agreement}"
    return trainer.export({"test": True})


@pytest.mark.parametrize("top_k,expand", [(1, 1), (3, 2)], ids=["chain", "tree"])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_a_trained_module_drafts_and_greedy_equals_plain_greedy(oracle_mtp, top_k, expand, penalty):
    head = MTPModuleHead(oracle_mtp, embed)
    settings = EagleSettings(top_k=top_k, expand=expand, depth=4, max_nodes=12, adaptive=False, min_chance=0.0)
    sampling = SamplingSettings(repeat_penalty=penalty)
    accepted = 0
    for seed in range(8):
        target = OracleTarget(VOCAB, seed=7, hidden_size=WIDE)
        prompt = oracle_prompt(300 + seed)
        gen = GenerationSettings(max_new_tokens=40, sampling=sampling)
        finished = list(generate(target, EagleDrafter(head, settings, costs=COSTS), prompt, gen, method="mtp-trained"))[-1]
        assert list(finished.tokens) == plain_greedy(OracleTarget(VOCAB, seed=7, hidden_size=WIDE), prompt, 40, sampling)
        accepted += finished.stats.accepted
    assert accepted > 16, f"the trained module had only {accepted} guesses accepted"


def test_train_cli_writes_an_mtp_module_that_drafts_as_plain_decoding_writes(smollm_q4_path, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from backends.cli import main
    from backends.factory import Session, SessionConfig

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [t]}) for t in ["Say hello.", "Count to five.", "Name a fruit."]) + "\n")
    assert main(["train", "mtp", "--model", str(smollm_q4_path), "--data", str(prompts), "--max-new-tokens", "24",
                 "--follow-ups", "1", "--steps", "4", "--out", str(tmp_path / "m.mtp")]) == 0
    head = HeadFile.load(tmp_path / "m.mtp.json")
    head.check_for(ModelFingerprint.of(smollm_q4_path), "mtp")
    with Session(SessionConfig(model=str(smollm_q4_path), n_ctx=1024, heads=(str(tmp_path / "m.mtp.json"),))) as session:
        prompt = session.model.chat_prompt([{"role": "user", "content": "Name three colours."}])
        plain = answer(session, "ar", prompt)
        ours = answer(session, "mtp-trained", prompt, {"top_k": 2, "adaptive": False})
        assert ours.stats.drafted > 0
        same_or_near_tie(session, "mtp-trained", prompt, ours, plain)


def test_sampling_with_a_trained_module_keeps_the_target_distribution(oracle_mtp):
    from tests.test_eagle import sampling_keeps_the_target_distribution

    head = MTPModuleHead(oracle_mtp, embed)
    settings = EagleSettings(top_k=3, expand=2, depth=3, max_nodes=8, adaptive=False)
    sampling_keeps_the_target_distribution(lambda: EagleDrafter(head, settings, costs=COSTS), VOCAB, WIDE)
