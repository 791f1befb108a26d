"""EAGLE-3: the inputs of chosen layers from the targets, the EAGLE-3 layer, its drafting.

Oracle tier: exact losslessness of the EAGLE-2 drafter running an EAGLE-3 head that reads two
"layers" of the oracle (chains and trees, a repetition penalty, many seeds). Real tier: llama.cpp
hands out SmolLM2's layer inputs, the same in a prefill and in one-token verifies, with the final
state among them equal to the one it hands out alone; a model whose graph keeps no layer inputs
is refused with the reason (llama.cpp itself would abort the process).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from backends.core.engine import generate
from backends.core.errors import BackendError, SpecDeckError
from backends.core.protocols import states_of
from backends.core.types import FINAL_STATE, HIDDEN_STATES, LAYER_STATES, GenerationSettings, Proposal, SamplingSettings, Verdict
from backends.drafters.eagle import EagleDrafter, EagleSettings
from backends.heads.eagle3 import KIND, Eagle3Head, Eagle3Shape, default_layers
from backends.heads.files import HeadFile, HeadMismatchError, ModelFingerprint
from tests.oracle import OracleTarget
from tests.test_engine import COSTS, plain_greedy
from tests.test_eagle import sampling_keeps_the_target_distribution
from tests.test_heads import oracle_prompt
from tests.test_real_models import answer, same_or_near_tie

VOCAB, WIDE = 32, 24
LAYERS = (0, 2)
FAKE_MODEL = ModelFingerprint("oracle", "oracle", "F32", 1, WIDE, VOCAB, "0" * 16)
SHAPE = Eagle3Shape(d=WIDE, n_head=4, n_kv_head=2, head_dim=6, d_ff=32, draft_vocab=VOCAB, layers=LAYERS, target_d=WIDE)
TABLE = np.random.default_rng(11).normal(size=(VOCAB, WIDE)).astype(np.float32)


def embed(tokens: np.ndarray) -> np.ndarray:
    return TABLE[np.asarray(tokens)]


def random_head(seed: int = 0) -> HeadFile:
    rng = np.random.default_rng(seed)
    tensors = {name: (rng.normal(size=shape) * (1.0 if len(shape) == 1 else 0.3)).astype(np.float16)
               for name, shape in SHAPE.tensor_shapes().items()}
    tensors["vocab"] = np.arange(VOCAB, dtype=np.int64)
    return HeadFile(KIND, SHAPE.config(), FAKE_MODEL, tensors, {})


def test_the_shape_round_trips_and_the_head_reads_the_fused_layers():
    assert Eagle3Shape.from_config(SHAPE.config()) == SHAPE
    head = Eagle3Head(random_head(), embed)
    assert head.state_layers == LAYERS and head.feature_width == len(LAYERS) * WIDE and head.d == WIDE
    drafter = EagleDrafter(head, EagleSettings(), costs=COSTS)
    assert drafter.state_layers == LAYERS and {HIDDEN_STATES, LAYER_STATES} <= drafter.requires
    with pytest.raises(SpecDeckError, match=f"reads {len(LAYERS) * WIDE}-wide hidden states"):
        drafter.begin([1, 2, 3], np.zeros((2, WIDE), np.float32))


def test_catching_up_row_by_row_equals_one_forward():
    head = Eagle3Head(random_head(3), embed)
    rng = np.random.default_rng(2)
    feats = head.features(rng.normal(size=(9, head.feature_width)).astype(np.float32))  # [9, d]
    tokens = rng.integers(0, VOCAB, size=9)
    whole = head.forward(feats, tokens, np.arange(9), head.new_cache(), np.tril(np.ones((9, 9), bool)))
    cache = head.new_cache()
    for i in range(9):
        row = head.forward(feats[i:i + 1], tokens[i:i + 1], np.arange(i, i + 1), cache, np.ones((1, 1), bool))
        cache.commit()
        np.testing.assert_allclose(row[0], whole[i], rtol=1e-4, atol=1e-4)
    lp = head.log_probs(whole)
    assert lp.shape == (9, VOCAB) and np.allclose(np.exp(lp).sum(-1), 1.0, atol=1e-5)
    assert feats.dtype == whole.dtype == lp.dtype == np.float32  # float64 made every product convert the weights


@pytest.mark.parametrize("top_k,expand", [(1, 1), (3, 2)], ids=["chain", "tree"])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_eagle3_greedy_equals_plain_greedy_on_the_oracle(top_k, expand, penalty):
    head = Eagle3Head(random_head(5), embed)
    settings = EagleSettings(top_k=top_k, expand=expand, depth=4, max_nodes=12, adaptive=False, min_chance=0.0)
    sampling = SamplingSettings(repeat_penalty=penalty)
    drafted = 0
    for seed in range(12):
        oracle = OracleTarget(VOCAB, seed=7, hidden_size=WIDE)
        prompt = oracle_prompt(100 + seed)
        finished = list(generate(oracle, EagleDrafter(head, settings, costs=COSTS), prompt,
                                 GenerationSettings(max_new_tokens=40, sampling=sampling), method="eagle3"))[-1]
        assert list(finished.tokens) == plain_greedy(oracle, prompt, 40, sampling), f"seed {seed} diverged"
        assert oracle._layers == LAYERS  # the engine asked the target for the head's layers
        drafted += finished.stats.drafted
    assert drafted > 12 * 20, "the head drafted almost nothing"


def random_eagle1(seed: int = 1) -> HeadFile:
    from backends.heads.eagle import KIND as EAGLE1, EagleShape

    shape = EagleShape(d=WIDE, n_head=4, n_kv_head=2, head_dim=6, d_ff=32, draft_vocab=VOCAB)
    rng = np.random.default_rng(seed)
    tensors = {name: (rng.normal(size=shape_) * (1.0 if len(shape_) == 1 else 0.3)).astype(np.float16)
               for name, shape_ in shape.tensor_shapes().items()}
    tensors["vocab"] = np.arange(VOCAB, dtype=np.int64)
    return HeadFile(EAGLE1, shape.config(), FAKE_MODEL, tensors, {})


def test_drafters_reading_different_layers_run_together_on_the_union():
    """An EAGLE-3 head (layers 0 and 2) and an EAGLE head (the final state) merged: the target is
    asked for the union side by side, each drafter reads its own blocks (a wrong width would be
    refused by the drafter), and greedy output is plain decoding's."""
    from backends.drafters.specinfer import SpecInferDrafter
    from backends.heads.eagle import EagleHead

    settings = EagleSettings(top_k=2, expand=2, depth=3, max_nodes=8, adaptive=False, min_chance=0.0)
    three = lambda: EagleDrafter(Eagle3Head(random_head(), embed), settings, costs=COSTS)  # noqa: E731
    one = lambda: EagleDrafter(EagleHead(random_eagle1(), embed), settings, costs=COSTS)  # noqa: E731
    a, b = three(), one()
    assert states_of([a, a]) == (a.prompt_states, LAYERS, [None, None])
    assert states_of([a, b]) == (a.prompt_states, (*LAYERS, FINAL_STATE), [(0, 1), (2,)])
    drafted = 0
    for seed in range(6):
        oracle = OracleTarget(VOCAB, seed=7, hidden_size=WIDE)
        prompt = oracle_prompt(seed)
        merged = SpecInferDrafter([three(), one()], costs=COSTS)
        assert merged.state_layers == (*LAYERS, FINAL_STATE)
        finished = list(generate(oracle, merged, prompt, GenerationSettings(max_new_tokens=30)))[-1]
        assert list(finished.tokens) == plain_greedy(OracleTarget(VOCAB, seed=7, hidden_size=WIDE), prompt, 30,
                                                     SamplingSettings())
        drafted += finished.stats.drafted
    assert drafted > 6 * 10


def test_default_layers_are_low_middle_high():
    assert default_layers(30) == (2, 15, 27)


def test_llama_target_hands_out_layer_inputs(smollm_q4_path):
    from backends.llamacpp.model import LlamaModel
    from backends.llamacpp.target import LlamaTarget

    with LlamaModel(smollm_q4_path) as model:
        d, layers = model.n_embd, (*default_layers(model.n_layer), FINAL_STATE)
        tokens = model.tokenize("The quick brown fox jumps over the lazy dog, and then it")
        whole = LlamaTarget(model, n_ctx=256)
        assert LAYER_STATES in whole.offers
        whole.prefill(tokens[:-1], hidden=True)
        final = whole.hidden_states(0, len(tokens) - 1)
        whole.prefill(tokens[:-1], hidden=True, layers=layers)  # other layers: the states start afresh
        states = whole.hidden_states(0, len(tokens) - 1)
        assert states.shape == (len(tokens) - 1, len(layers) * d)
        scale = np.abs(states).max()
        np.testing.assert_allclose(states[:, 3 * d:], final, atol=1e-6 * scale)  # FINAL_STATE: the same state
        means = [float(np.abs(states[:, i * d:(i + 1) * d]).mean()) for i in range(3)]
        assert len(set(np.round(means, 3))) == 3, f"the layers' inputs look alike: {means}"
        out = whole.verify(tokens[-1], Proposal((11, 12, 13), (-1, 0, -1)))  # a tree: one state per node
        assert out.hidden.shape == (4, len(layers) * d)
        stepwise = LlamaTarget(model, n_ctx=256)
        stepwise.prefill(tokens[:1], hidden=True, layers=layers)
        rows = [stepwise.hidden_states(0, 1)[0]]
        for token in tokens[1:-1]:
            rows.append(stepwise.verify(token, Proposal()).hidden[0])
            stepwise.commit(Verdict((), (0,), 0, 0))
        assert np.abs(np.stack(rows) - states).max() < 0.01 * scale  # batch rounding only
        with pytest.raises(BackendError, match="layers 0..29"):
            whole.prefill(tokens, hidden=True, layers=(30,))
        whole.close()
        stepwise.close()


def test_a_model_whose_graph_keeps_no_layer_inputs_is_refused(gemma_path):
    from backends.llamacpp.model import LlamaModel
    from backends.llamacpp.target import LlamaTarget

    with LlamaModel(gemma_path) as model:
        target = LlamaTarget(model, n_ctx=128)
        assert HIDDEN_STATES in target.offers and LAYER_STATES not in target.offers
        with pytest.raises(BackendError, match="cannot hand out the inputs of its layers"):
            target.prefill(model.tokenize("Hello there"), hidden=True, layers=(1, 2))
        target.prefill(model.tokenize("Hello there"), hidden=True)  # the final state still comes
        assert target.hidden_states(0, 2).shape == (2, model.n_embd)
        target.close()


def test_eagle3_without_a_head_is_refused_with_the_command_that_makes_one(smollm_session, monkeypatch, tmp_path):
    monkeypatch.setattr("backends.heads.files.SHIPPED", tmp_path)  # as if SpecDeck shipped no head for SmolLM2
    smollm_session.forget_heads()
    try:
        with pytest.raises(SpecDeckError, match="specdeck train eagle3"):
            smollm_session.drafter("eagle3", SamplingSettings())
    finally:
        smollm_session.forget_heads()


def trained_twin(seed: int = 0):
    """The torch module with random weights, and the head file holding them (float16-rounded on both sides)."""
    torch = pytest.importorskip("torch", reason="training needs torch (installed by the test extra)")
    from backends.heads.eagle3_training import eagle3_module

    torch.manual_seed(seed)
    model = eagle3_module(torch, SHAPE, np.random.default_rng(seed).normal(size=(VOCAB, WIDE)).astype(np.float32))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
        for name, p in model.named_parameters():
            p.copy_(p.half().float())
    tensors = {("lm.weight" if k == "lm" else k): v.numpy().astype(np.float16)
               for k, v in model.state_dict().items()}
    tensors["vocab"] = np.arange(VOCAB, dtype=np.int64)
    return model, HeadFile(KIND, SHAPE.config(), FAKE_MODEL, tensors, {})


def test_numpy_layer_equals_its_torch_twin_in_chains():
    torch = pytest.importorskip("torch")
    model, head_file = trained_twin()
    head = Eagle3Head(head_file, embed)
    rng = np.random.default_rng(1)
    L = 16
    states = rng.normal(size=(L, head.feature_width)).astype(np.float32)
    tokens = rng.integers(0, VOCAB, size=L)
    positions = np.arange(3, 3 + L)
    with torch.no_grad():
        feat = model.features(torch.from_numpy(states)[None])
        preds = model.chain(torch.from_numpy(embed(tokens))[None], feat, torch.from_numpy(positions)[None], 3)
        logits = [model.logits(p)[0].numpy() for p in preds]
    cache = head.new_cache()
    ours = head.forward(head.features(states), tokens, positions, cache, np.tril(np.ones((L, L), bool)))
    np.testing.assert_allclose(ours, preds[0][0].numpy(), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(head.log_probs(ours), torch.from_numpy(logits[0]).log_softmax(-1).numpy(), atol=1e-3)
    cache.commit()
    t, state = L - 4, ours[L - 4]
    cache = head.new_cache()
    head.forward(head.features(states[: t + 1]), tokens[: t + 1], positions[: t + 1], cache, np.tril(np.ones((t + 1,) * 2, bool)))
    cache.commit()
    for level in (1, 2):  # the drafter's chain from row t: its own output, the next true token
        state = head.forward(state[None], tokens[t + level: t + level + 1], positions[t:t + 1] + level, cache,
                             np.ones((1, level), bool))[0]
        np.testing.assert_allclose(state, preds[level][0, t].numpy(), rtol=1e-3, atol=1e-3)


def test_training_on_the_oracle_learns_and_stays_lossless(tmp_path):
    pytest.importorskip("torch")
    from backends.heads.eagle3_training import Eagle3TrainConfig, Eagle3Trainer
    from backends.heads.eagle_training import eagle_sequences
    from backends.heads.record import Recorder
    from backends.heads.training import draft_vocabulary

    oracle = OracleTarget(VOCAB, seed=7, hidden_size=WIDE)
    rng = np.random.default_rng(0)
    samples = []
    for i in range(60):
        prompt = rng.integers(0, VOCAB, size=12).tolist()
        recorder = Recorder((*LAYERS, FINAL_STATE))
        assert LAYER_STATES in recorder.requires
        events = list(generate(oracle, recorder, prompt, GenerationSettings(max_new_tokens=40)))
        samples.append((i, recorder.sample(prompt, events[-1].tokens)))
    assert samples[0][1].states.shape[1] == (len(LAYERS) + 1) * WIDE
    config = Eagle3TrainConfig(draft_vocab=VOCAB, lr=1e-2, batch=8, chunk=48, depth=3, eval_every=40, max_epochs=60,
                               precision="float32")  # the same instrument on every PC
    vocab = draft_vocabulary([s for _, s in samples], VOCAB, [], VOCAB)
    data = eagle_sequences(samples, vocab, VOCAB, config.chunk, embed)
    lm = (np.random.default_rng(5).normal(size=(VOCAB, WIDE)) * 0.3).astype(np.float32)
    trainer = Eagle3Trainer(data, vocab, lm, SHAPE, FAKE_MODEL, config, tmp_path / "e3.safetensors", device="cpu")
    before = trainer.agreement()
    result = trainer.run(200)
    assert result.agreement[0] > max(3 / VOCAB, before[0] + 0.1), f"depth 1 learned little: {before} -> {result.agreement}"
    head = Eagle3Head(trainer.export({"test": True}), embed)
    settings = EagleSettings(top_k=3, expand=2, depth=4, max_nodes=12, adaptive=False)
    sampling = EagleSettings(top_k=3, expand=2, depth=3, max_nodes=8, adaptive=False)
    sampling_keeps_the_target_distribution(lambda: EagleDrafter(head, sampling, costs=COSTS), VOCAB, WIDE)
    accepted = 0
    for seed in range(6):
        target = OracleTarget(VOCAB, seed=7, hidden_size=WIDE)
        prompt = oracle_prompt(200 + seed)
        finished = list(generate(target, EagleDrafter(head, settings, costs=COSTS), prompt,
                                 GenerationSettings(max_new_tokens=40), method="eagle3"))[-1]
        assert list(finished.tokens) == plain_greedy(target, prompt, 40, SamplingSettings())
        accepted += finished.stats.accepted
    assert accepted > 24, f"the trained head had only {accepted} guesses accepted"


def test_train_cli_records_layers_and_writes_an_eagle3_head_that_drafts_losslessly(smollm_q4_path, tmp_path, monkeypatch):
    """`specdeck train eagle3` end to end on the real model (a few prompts, a few steps): the
    recording holds the three layers' inputs and the final state, the head loads for this model
    and nothing else, and a session drafting with it writes what plain decoding writes."""
    pytest.importorskip("torch", reason="training needs torch (installed by the test extra)")
    from backends.cli import main
    from backends.factory import Session, SessionConfig
    from backends.heads.record import SampleStore
    from backends.hardware.fit import method_extra
    from backends.drafters import method_spec

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [t]}) for t in
                                 ["Say hello.", "Count to five.", "Name a fruit.", "What is 2+2?"]) + "\n")
    out = tmp_path / "h.eagle3"
    assert main(["train", "eagle3", "--model", str(smollm_q4_path), "--data", str(prompts), "--max-new-tokens", "24",
                 "--steps", "6", "--out", str(out)]) == 0
    config = tmp_path / "h.eagle3.json"
    head = HeadFile.load(config)
    head.check_for(ModelFingerprint.of(smollm_q4_path), "eagle3")
    assert head.config["layers"] == [2, 15, 27] and head.config["target_d"] == 576
    stores = list((tmp_path / "cache").rglob("source.json"))
    assert len(stores) == 1 and "layers2_15_27_-1" in str(stores[0].parent)
    _, sample = next(SampleStore(stores[0].parent, json.loads(stores[0].read_text())).samples())
    assert sample.states.shape[1] == 4 * 576
    # an EAGLE head for the same data trains from this recording's final states: nothing recorded again
    assert main(["train", "eagle", "--model", str(smollm_q4_path), "--data", str(prompts), "--max-new-tokens", "24",
                 "--steps", "2", "--out", str(tmp_path / "h.eagle")]) == 0
    assert len(list((tmp_path / "cache").rglob("source.json"))) == 1
    eagle = HeadFile.load(tmp_path / "h.eagle.json")
    assert eagle.kind == "eagle" and eagle.tensor("fc.weight").shape == (576, 2 * 576)
    extra = method_extra(method_spec("eagle3"), 4096, hidden_size=576)
    assert [t.bytes for t in extra.terms if "hidden states" in t.name] == [4096 * 3 * 576 * 2]
    with Session(SessionConfig(model=str(smollm_q4_path), n_ctx=1024, heads=(str(config),))) as session:
        prompt = session.model.chat_prompt([{"role": "user", "content": "Name three colours."}])
        plain = answer(session, "ar", prompt)
        # numpy's head, and the same head exported to llama.cpp's eagle3 architecture and run by llama.cpp
        for method in ("eagle3", "eagle3-native"):
            ours = answer(session, method, prompt, {"top_k": 2, "adaptive": False})
            assert ours.stats.drafted > 0
            same_or_near_tie(session, method, prompt, ours, plain)
    with pytest.raises(HeadMismatchError):
        head.check_for(ModelFingerprint("other", "gemma3", "Q4_K", 1, 640, 262144, "f" * 16), "eagle3")


def test_train_eagle3_reads_the_answers_of_another_recording_again_instead_of_answering_anew(smollm_q4_path, tmp_path,
                                                                                          monkeypatch):
    """Conversations recorded for a head of the final state (Medusa here) are not answered again for
    an EAGLE-3 head: their recorded tokens are prefilled (a conversation's turns reusing the cache)
    and the three layers and the final state kept, in the same samples; the final states read
    again are the recorded ones up to batch rounding, position for position."""
    pytest.importorskip("torch", reason="training needs torch (installed by the test extra)")
    from backends.heads.record import SampleStore
    from backends.train import TrainRequest, train

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [t]}) for t in ["Say hello.", "Name a fruit.", "What is 2+2?"]) + "\n")
    common = dict(model=str(smollm_q4_path), data=str(prompts), max_new_tokens=24, follow_ups=1, minutes=60)
    events: list[dict] = []
    train(TrainRequest(kind="medusa", steps=2, out=tmp_path / "h.medusa", **common), report=events.append)
    assert any(e["phase"] == "record" for e in events)
    events.clear()
    train(TrainRequest(kind="eagle3", steps=2, out=tmp_path / "h.eagle3", **common), report=events.append)
    phases = [e["phase"] for e in events]
    assert "record" not in phases and "questions" not in phases, phases  # nothing answered anew
    assert [e for e in events if e["phase"] == "reread"][-1]["done"] == 3
    HeadFile.load(tmp_path / "h.eagle3.json").check_for(ModelFingerprint.of(smollm_q4_path), "eagle3")
    folders = {f.parent.name: f.parent for f in (tmp_path / "cache").rglob("source.json")}
    assert len(folders) == 2
    donor, layered = (SampleStore(f, json.loads((f / "source.json").read_text()))
                      for f in sorted(folders.values(), key=lambda f: "layers" in f.name))
    assert donor.indices() == layered.indices() and len(donor.indices()) == 6  # 3 conversations of 2 turns
    for n in donor.indices():
        a, b = donor.get(n), layered.get(n)
        assert np.array_equal(a.tokens, b.tokens) and a.n_prompt == b.n_prompt
        assert b.states.shape == (len(b.tokens) - 1, 4 * 576)
        was, now = a.states.astype(np.float32), b.states[:, 3 * 576 :].astype(np.float32)
        cos = (was * now).sum(1) / (np.linalg.norm(was, axis=1) * np.linalg.norm(now, axis=1))
        assert cos.min() > 0.99, (n, cos.min())  # a state one position off would not be near


def smollm_shaped_head(model_path, seed: int = 0, draft_vocab: int = 512, target_d: int = 576) -> HeadFile:
    """A random EAGLE-3 head for SmolLM2 (its width, heads and three layers), scaled like a trained one."""
    fp = ModelFingerprint.of(model_path)
    shape = Eagle3Shape(d=576, n_head=9, n_kv_head=3, head_dim=64, d_ff=1536, draft_vocab=draft_vocab,
                        layers=(2, 15, 27), target_d=target_d)
    rng = np.random.default_rng(seed)
    tensors = {name: ((1 + 0.1 * rng.normal(size=shape_)) if len(shape_) == 1
                      else rng.normal(size=shape_) / np.sqrt(shape_[1])).astype(np.float16)
               for name, shape_ in shape.tensor_shapes().items()}
    tensors["vocab"] = np.sort(rng.choice(fp.n_vocab, draft_vocab, replace=False)).astype(np.int64)
    return HeadFile(KIND, shape.config(), fp, tensors, {})


def test_llama_cpp_runs_an_exported_head_as_numpy_does(smollm_q4_path, tmp_path):
    """Exported to llama.cpp's eagle3 architecture (RoPE rows permuted, d2t) and run by llama.cpp
    beside the target, a head gives numpy's features, states and log-probabilities along a chain,
    to float16 rounding, and starts its chain over after a gap in the rows; a GGUF made for
    another width is refused with the reason."""
    from backends.heads.eagle3_gguf import export_eagle3_gguf
    from backends.llamacpp.model import LlamaModel
    from backends.llamacpp.target import LlamaTarget
    from backends.models.weights import TokenEmbeddings

    head = smollm_shaped_head(smollm_q4_path)
    path = export_eagle3_gguf(head, smollm_q4_path, tmp_path / "head.gguf")
    ours = Eagle3Head(head, TokenEmbeddings(smollm_q4_path))
    rng = np.random.default_rng(1)
    states = (rng.normal(size=(7, 3 * 576)) * 3).astype(np.float32)
    tokens = rng.integers(0, 49152, size=8)
    with LlamaModel(smollm_q4_path) as model:
        target = LlamaTarget(model, n_ctx=256)
        theirs = target.engine_head(str(path))
        assert theirs.state_layers == (2, 15, 27) and np.array_equal(theirs.vocab, ours.vocab)
        feats = ours.features(states)
        np.testing.assert_allclose(theirs.features(states), feats, atol=0.02 * np.abs(feats).max())
        mine_cache, their_cache = ours.new_cache(), theirs.new_cache()
        chain = np.tril(np.ones((7, 7), bool))
        a = ours.forward(feats, tokens[:7], np.arange(7), mine_cache, chain)
        b = theirs.forward(feats, tokens[:7], np.arange(7), their_cache, chain)
        np.testing.assert_allclose(b, a, atol=0.01 * np.abs(a).max())
        assert (theirs.log_probs(b).argmax(-1) == ours.log_probs(a).argmax(-1)).all()
        last_cache = theirs.new_cache()  # a catch-up wanting the last row alone computes its logits alone
        b_last = theirs.forward(feats, tokens[:7], np.arange(7), last_cache, chain, outputs=1)
        assert b_last.shape == (1, 576)
        np.testing.assert_allclose(b_last, b[-1:], atol=1e-5)
        np.testing.assert_allclose(theirs.log_probs(b_last), ours.log_probs(a[-1:]), atol=0.05)
        mine_cache.commit(), their_cache.commit()
        a2 = ours.forward(a[-1:], tokens[7:], np.array([7]), mine_cache, np.ones((1, 1), bool))  # a draft row
        b2 = theirs.forward(b[-1:], tokens[7:], np.array([7]), their_cache, np.ones((1, 1), bool))
        np.testing.assert_allclose(b2, a2, atol=0.01 * np.abs(a2).max())
        with pytest.raises(BackendError, match="chains"):
            theirs.forward(feats[:2], tokens[:2], np.array([8, 8]), their_cache, np.ones((2, 2), bool))
        # true states after a gap (an idle drafter keeps only its last rows): the chain starts
        # over there and reads as a fresh cache would; a row before its end is refused
        their_cache.drop_scratch()
        two = np.tril(np.ones((2, 2), bool))
        b3 = theirs.forward(feats[:2], tokens[:2], np.array([10, 11]), their_cache, two)
        assert (their_cache.first, their_cache.length) == (10 + theirs.offset, 2)
        np.testing.assert_allclose(b3, theirs.forward(feats[:2], tokens[:2], np.array([10, 11]), theirs.new_cache(), two),
                                   atol=1e-5)
        their_cache.commit()
        with pytest.raises(BackendError, match="continue the cache"):
            theirs.forward(feats[:1], tokens[:1], np.array([5]), their_cache, np.ones((1, 1), bool))
        wide = export_eagle3_gguf(smollm_shaped_head(smollm_q4_path, target_d=640), smollm_q4_path, tmp_path / "w.gguf")
        with pytest.raises(HeadMismatchError, match="width 640 vs 576"):
            target.engine_head(str(wide))
        target.close()


def write_published(head: HeadFile, folder, vocab_size: int) -> None:
    """``head`` in the EAGLE / SpecForge layout: config.json, HF names, d2t as offsets."""
    from safetensors.numpy import save_file

    from backends.heads.published import NAMES

    s = Eagle3Shape.from_config(head.config)
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": s.d, "num_attention_heads": s.n_head,
              "num_key_value_heads": s.n_kv_head, "intermediate_size": s.d_ff, "rms_norm_eps": s.eps,
              "rope_theta": s.rope_theta, "vocab_size": vocab_size, "draft_vocab_size": s.draft_vocab,
              "num_hidden_layers": 1, "target_hidden_size": s.target_d}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {theirs: head.tensors[ours] for theirs, ours in NAMES.items()}
    vocab = head.tensors["vocab"]
    tensors["d2t"] = (vocab - np.arange(len(vocab))).astype(np.int64)
    save_file(tensors, str(folder / "model.safetensors"))


def test_a_published_head_folder_drafts_for_its_model_and_is_refused_for_another(smollm_q4_path, tmp_path):
    """A head in the EAGLE / SpecForge layout reads into the same head (d2t offsets to ids), drafts
    in a session with output equal to plain decoding, and is refused, with what differs, for a
    model of another vocabulary; pickled weights are refused."""
    from backends.factory import Session, SessionConfig
    from backends.heads.published import read_published_eagle3

    head = smollm_shaped_head(smollm_q4_path, seed=4)
    write_published(head, tmp_path / "ours", 49152)
    read = read_published_eagle3(tmp_path / "ours", smollm_q4_path)
    for name, value in head.tensors.items():
        assert np.array_equal(read.tensors[name], value), name
    write_published(head, tmp_path / "theirs", 128256)
    with pytest.raises(HeadMismatchError, match="vocabulary 128256 vs 49152"):
        read_published_eagle3(tmp_path / "theirs", smollm_q4_path)
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "config.json").write_text((tmp_path / "ours" / "config.json").read_text())
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(SpecDeckError, match="pickles"):
        read_published_eagle3(tmp_path / "pickled", smollm_q4_path)
    with Session(SessionConfig(model=str(smollm_q4_path), n_ctx=512)) as session:
        prompt = session.model.chat_prompt([{"role": "user", "content": "Name three colours."}])
        plain = answer(session, "ar", prompt)
        for method in ("eagle3", "eagle3-native"):
            ours = answer(session, method, prompt, {"head": str(tmp_path / "ours"), "adaptive": False})
            assert ours.stats.drafted > 0
            same_or_near_tie(session, method, prompt, ours, plain)
