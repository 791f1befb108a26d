"""EAGLE heads: the numpy layer against its torch twin, the EAGLE-2 drafter, training.

Oracle tier: exact losslessness (chains and trees, a repetition penalty, many seeds) with a head
trained by the real training code on the oracle's own answers; the drafter's head cache (catching
up incrementally, scratch rows dropped) against one full forward. The real tier (SmolLM2 with the
shipped head) lives in test_real_models.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from backends.core.engine import generate
from backends.core.sampling import target_distribution
from backends.core.types import Budget, GenerationSettings, SamplingSettings, TargetLimits
from backends.drafters.eagle import EagleDrafter, EagleSettings
from backends.heads.eagle import EagleHead, EagleShape
from backends.heads.files import HeadFile, ModelFingerprint
from tests.oracle import OracleTarget
from tests.test_engine import COSTS, plain_greedy
from tests.test_heads import accepted_matching_plain_greedy, oracle_prompt, record_oracle

torch = pytest.importorskip("torch", reason="training needs torch (installed by the test extra)")

VOCAB, WIDE = 32, 24
FAKE_MODEL = ModelFingerprint("oracle", "oracle", "F32", 1, WIDE, VOCAB, "0" * 16)
SHAPE = EagleShape(d=WIDE, n_head=4, n_kv_head=2, head_dim=6, d_ff=32, draft_vocab=VOCAB)
TABLE = np.random.default_rng(11).normal(size=(VOCAB, WIDE)).astype(np.float32)


def embed(tokens: np.ndarray) -> np.ndarray:
    return TABLE[np.asarray(tokens)]


def random_head(seed: int = 0) -> HeadFile:
    """A head with random weights in every tensor (the torch module's init is near identity)."""
    from backends.heads.eagle_training import eagle_module

    torch.manual_seed(seed)
    model = eagle_module(torch, SHAPE, np.random.default_rng(seed).normal(size=(VOCAB, WIDE)).astype(np.float32))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    tensors = {("lm.weight" if k == "lm" else k): v.numpy().astype(np.float16) for k, v in model.state_dict().items()}
    model.load_state_dict({k: torch.from_numpy(tensors["lm.weight" if k == "lm" else k].astype(np.float32))
                           for k in model.state_dict()})  # both sides hold the float16-rounded weights
    tensors["vocab"] = np.arange(VOCAB, dtype=np.int64)
    return HeadFile("eagle", SHAPE.config(), FAKE_MODEL, tensors, {}), model


def test_numpy_layer_equals_its_torch_twin_in_forward_and_chains():
    head_file, model = random_head()
    head = EagleHead(head_file, embed)
    rng = np.random.default_rng(1)
    L = 20
    feats = rng.normal(size=(L, WIDE)).astype(np.float32)
    tokens = rng.integers(0, VOCAB, size=L)
    positions = np.arange(5, 5 + L)
    cache = head.new_cache()
    ours = head.forward(feats, tokens, positions, cache, np.tril(np.ones((L, L), bool)))
    emb = torch.from_numpy(embed(tokens))[None]
    preds = model.chain(emb, torch.from_numpy(feats)[None], torch.from_numpy(positions)[None], 3)
    np.testing.assert_allclose(ours, preds[0][0].detach().numpy(), rtol=1e-4, atol=1e-4)
    # depth 2 and 3 of the chain from row t, as the drafter runs them over the committed rows 0..t
    t = 11
    cache = head.new_cache()
    head.forward(feats[: t + 1], tokens[: t + 1], positions[: t + 1], cache, np.tril(np.ones((t + 1,) * 2, bool)))
    cache.commit()
    state = ours[t]
    for level in (1, 2):
        state = head.forward(state[None], tokens[t + level: t + level + 1], positions[t:t + 1] + level, cache,
                             np.ones((1, level), bool))[0]
        np.testing.assert_allclose(state, preds[level][0, t].detach().numpy(), rtol=1e-4, atol=1e-4)
    cache.drop_scratch()
    assert cache.length == cache.committed == t + 1


def test_the_numpy_layer_computes_in_float32_throughout():
    """Under NumPy 2 a numpy float64 scalar (``1 / np.sqrt(hd)``) makes a float32 array float64:
    the attention scores were, and so every later product converted the weights to float64 on each
    call (an EAGLE head's depth took 7.7 ms on the Intel Xeon here, 2.0 ms in float32)."""
    head = EagleHead(random_head()[0], embed)
    rng = np.random.default_rng(4)
    feats = rng.normal(size=(3, WIDE)).astype(np.float32)
    out = head.forward(feats, rng.integers(0, VOCAB, size=3), np.arange(3), head.new_cache(), np.tril(np.ones((3, 3), bool)))
    assert out.dtype == np.float32 and head.log_probs(out).dtype == np.float32


def test_catching_up_row_by_row_equals_one_forward():
    head_file, _ = random_head(3)
    head = EagleHead(head_file, embed)
    rng = np.random.default_rng(2)
    feats = rng.normal(size=(9, WIDE)).astype(np.float32)
    tokens = rng.integers(0, VOCAB, size=9)
    whole = head.forward(feats, tokens, np.arange(9), head.new_cache(), np.tril(np.ones((9, 9), bool)))
    cache = head.new_cache()
    for i in range(9):
        row = head.forward(feats[i:i + 1], tokens[i:i + 1], np.arange(i, i + 1), cache, np.ones((1, 1), bool))
        cache.commit()
        np.testing.assert_allclose(row[0], whole[i], rtol=1e-5, atol=1e-5)
    # a catch-up that wants the last row's prediction alone: the same row, and a cache that reads on the same
    for split in (4, 9):
        cache = head.new_cache()
        last = head.forward(feats[:split], tokens[:split], np.arange(split), cache, np.tril(np.ones((split,) * 2, bool)),
                            outputs=1)
        cache.commit()
        assert last.shape == (1, WIDE)
        np.testing.assert_allclose(last[0], whole[split - 1], rtol=1e-5, atol=1e-5)
        if split < 9:
            rest = head.forward(feats[split:], tokens[split:], np.arange(split, 9), cache,
                                np.tril(np.ones((9 - split,) * 2, bool)), outputs=2)
            np.testing.assert_allclose(rest, whole[-2:], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def oracle_eagle(tmp_path_factory) -> HeadFile:
    """An EAGLE head trained with torch on the oracle's own answers (the real training code)."""
    from backends.heads.eagle_training import EagleTrainConfig, EagleTrainer, eagle_sequences
    from backends.heads.training import draft_vocabulary

    oracle = OracleTarget(VOCAB, seed=7, hidden_size=WIDE)
    rng = np.random.default_rng(0)
    samples = record_oracle(oracle, [rng.integers(0, VOCAB, size=12).tolist() for _ in range(60)], 40)
    config = EagleTrainConfig(draft_vocab=VOCAB, lr=1e-2, batch=8, chunk=48, eval_every=40, max_epochs=60, noise=0.05,
                              train_lm=True, precision="float32")  # the same instrument on every PC
    vocab = draft_vocabulary([s for _, s in samples], VOCAB, [], VOCAB)
    data = eagle_sequences(samples, vocab, VOCAB, config.chunk, embed)
    lm = np.random.default_rng(5).normal(size=(VOCAB, WIDE)) * 0.3
    trainer = EagleTrainer(data, vocab, lm.astype(np.float32), SHAPE, FAKE_MODEL, config,
                           tmp_path_factory.mktemp("ckpt") / "e.safetensors", device="cpu")
    result = trainer.run(240)
    assert result.agreement[0] > 3 / VOCAB, f"depth 1 learned nothing: {result.agreement}"
    return trainer.export({"test": True})


@pytest.mark.parametrize("top_k,expand", [(1, 1), (3, 2)], ids=["chain", "tree"])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_eagle2_greedy_equals_plain_greedy_on_the_oracle(oracle_eagle, top_k, expand, penalty):
    head = EagleHead(oracle_eagle, embed)
    settings = EagleSettings(top_k=top_k, expand=expand, depth=4, max_nodes=12, adaptive=False)
    accepted = accepted_matching_plain_greedy(lambda: EagleDrafter(head, settings, costs=COSTS),
                                              method="eagle2", penalty=penalty)
    assert accepted > 48, f"the trained head had only {accepted} guesses accepted over 12 answers"


def chi_square(counts: np.ndarray, p: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic, cells expecting under 5 pooled; and its degrees of freedom."""
    expected = p * counts.sum()
    assert counts[expected == 0].sum() == 0, "a token the target never samples was emitted"
    big = expected >= 5
    chi2 = float(((counts[big] - expected[big]) ** 2 / expected[big]).sum())
    rest = expected[~big].sum()
    if rest > 0:
        chi2 += float((counts[~big].sum() - rest) ** 2 / rest)
    return chi2, int(big.sum()) + (rest > 0) - 1


def sampling_keeps_the_target_distribution(make_drafter, vocab: int, width: int, runs: int = 800) -> None:
    """The first and second tokens after a fixed prompt, sampled ``runs`` times through the engine
    with drafters from ``make_drafter``, follow the oracle's exact distributions (the second: its
    marginal over the first); the drafts must have been accepted often enough to matter."""
    prompt = oracle_prompt(3)
    truth = OracleTarget(vocab, seed=7, hidden_size=width)
    plain = SamplingSettings(temperature=1.0)

    def p(history: list[int]) -> np.ndarray:
        return target_distribution(truth.logits_for(history), history, plain)

    p1 = p(prompt)
    p2 = sum(p1[x] * p(prompt + [x]) for x in range(vocab))
    counts = np.zeros((2, vocab))
    accepted = 0
    for seed in range(runs):
        oracle = OracleTarget(vocab, seed=7, hidden_size=width)
        sampling = SamplingSettings(temperature=1.0, seed=seed)
        finished = list(generate(oracle, make_drafter(), prompt, GenerationSettings(max_new_tokens=2, sampling=sampling)))[-1]
        counts[0, finished.tokens[0]] += 1
        counts[1, finished.tokens[1]] += 1
        accepted += finished.stats.accepted
    assert accepted > 25, f"only {accepted} drafted tokens accepted: the test would not exercise the trees"
    for k, exact in enumerate((p1, p2)):
        chi2, dof = chi_square(counts[k], exact)
        assert chi2 < dof + 5 * np.sqrt(2 * dof), f"token {k + 1}: chi2 {chi2:.1f} for {dof} degrees of freedom"


def test_eagle2_sampling_keeps_the_target_distribution(oracle_eagle):
    head = EagleHead(oracle_eagle, embed)
    settings = EagleSettings(top_k=3, expand=2, depth=3, max_nodes=8, adaptive=False)
    sampling_keeps_the_target_distribution(lambda: EagleDrafter(head, settings, costs=COSTS), VOCAB, WIDE)


def test_the_drafter_waits_until_it_knows_the_root_state(oracle_eagle):
    head = EagleHead(oracle_eagle, embed)
    drafter = EagleDrafter(head, EagleSettings(adaptive=False), costs=COSTS)
    budget = Budget.for_step(TargetLimits(max_batch=64, max_paths=8), room=100, wanted=100)
    drafter.begin([1, 2, 3], np.zeros((2, WIDE), np.float32))
    assert drafter.propose([1, 2, 3], budget).size > 0
    drafter.begin([3], np.zeros((0, WIDE), np.float32))  # a one-token prompt: no state before the root
    assert drafter.propose([3], budget).size == 0


@pytest.mark.parametrize("pays", [True, False], ids=["winning", "losing"])
def test_a_losing_head_catches_up_on_recent_rows_only(oracle_eagle, pays):
    """While its gate finds drafting loses, a head's re-try must not run the whole prompt through
    it (on SmolLM2 F16's rag prompts eagle2 spent 0.75 ms a step that way and verified nothing)."""
    from backends.core.controller import RUN, Bandit
    from backends.drafters.eagle import CONTEXT_ROWS, IDLE_ROWS

    gate = Bandit([RUN], baseline="off", min_tries=1, explore_share=0.0)
    gate.update(RUN, 1.0, 1.0 if pays else 10.0)  # one step: a token for one forward, or for ten
    head = EagleHead(oracle_eagle, embed)
    drafter = EagleDrafter(head, EagleSettings(), costs=COSTS, gate=gate)
    budget = Budget.for_step(TargetLimits(max_batch=64, max_paths=8), room=1000, wanted=100)
    prompt = np.random.default_rng(3).integers(0, VOCAB, size=201).tolist()
    drafter.begin(prompt, np.random.default_rng(4).normal(size=(200, WIDE)).astype(np.float32))
    drafter.propose(prompt, budget)
    if not pays:  # closed this step; drafting starts to pay: the next step catches up
        assert drafter.cache.committed == 0
        gate.update(RUN, 50.0, 1.0)
        drafter.propose(prompt, budget)
    assert drafter.cache.committed == (min(200, CONTEXT_ROWS) if pays else IDLE_ROWS) and CONTEXT_ROWS > IDLE_ROWS


def test_reading_a_backlog_of_states_is_not_charged_to_one_step(oracle_eagle):
    """The head's catch-up on the prompt's states is paid once for all the steps after it: charged
    to the answer's first step (here 10 target forwards of head time for 200 rows), it made a head
    that pays step by step look like a loss and the gate shut it (SmolLM2 F16: 0.98x where a chain
    of one guess ran 1.19x). The steps' own catch-up and levels stay charged."""
    from backends.core.controller import RUN, Bandit

    class Recorded(Bandit):
        def update(self, arm, gain, cost):
            charged.append(cost)
            super().update(arm, gain, cost)

    now, per_row, charged = [0.0], 0.05, []  # a head row costs a twentieth of a target forward (COSTS: 1 s)
    head = EagleHead(oracle_eagle, embed)
    forward = head.forward

    def timed_forward(feats, tokens, *args, **kwargs):
        now[0] += per_row * len(tokens)
        return forward(feats, tokens, *args, **kwargs)

    head.forward = timed_forward
    prompt = np.random.default_rng(3).integers(0, VOCAB, size=201).tolist()
    gate = Recorded([RUN], baseline="off", min_tries=16, decay=0.99, try_loss=0.5)  # TreeSteps' own
    settings = EagleSettings(context_rows=512)  # the whole prompt is the backlog
    drafter = EagleDrafter(head, settings, costs=COSTS, gate=gate, clock=lambda: now[0])
    oracle = OracleTarget(VOCAB, seed=7, hidden_size=WIDE, n_ctx=2048)
    final = list(generate(oracle, drafter, prompt, GenerationSettings(max_new_tokens=40)))[-1]
    assert list(final.tokens) == plain_greedy(OracleTarget(VOCAB, seed=7, hidden_size=WIDE), prompt, 40,
                                              SamplingSettings())
    backlog = 200 * per_row
    assert now[0] > backlog and charged  # the backlog was read, and the steps drafted
    # a step: its verify (at most 1.4 forwards) and its own rows and levels (at most 1 + 4 x 4 rows)
    assert max(charged) < 1.4 + 17 * per_row < backlog, charged


@pytest.mark.parametrize("level", [0.002, 0.02, 5.0], ids=["cheap", "dear", "dearer-than-any-guess"])
def test_the_tree_grows_no_deeper_than_its_nodes_or_a_levels_cost_allow(oracle_eagle, level):
    """Every tree level is a head forward (on 2 CPU cores a numpy EAGLE level cost 0.28 of a
    SmolLM2 F16 forward). A tree of at most 2 nodes needs no level past depth 2, however deep the
    settings allow; an adaptive drafter grows a level only while the likeliest node it expands,
    times the odds its best child had at that depth, is likelier than the level's measured cost in
    target forwards (the cost model's one-row forward is 1 s here; the level's seconds come from
    the drafter's clock, moved by the head's forwards)."""
    from backends.core.controller import RUN, Bandit

    head = EagleHead(oracle_eagle, embed)
    now, forwards = [0.0], []
    forward = head.forward

    def timed_forward(feats, tokens, *args, **kwargs):
        forwards.append(len(tokens))
        now[0] += level
        return forward(feats, tokens, *args, **kwargs)

    head.forward = timed_forward
    budget = Budget.for_step(TargetLimits(max_batch=64, max_paths=8), room=100, wanted=100)
    prompt = oracle_prompt(5)
    hidden = np.random.default_rng(4).normal(size=(len(prompt) - 1, WIDE)).astype(np.float32)

    def levels(settings: EagleSettings) -> tuple[int, list[float], dict[int, float]]:
        """Head forwards of the second tree (the first measured a level and its odds), its best
        chance by depth, and the best child's odds by depth."""
        from backends.core.tree import depth_list

        gate = Bandit([RUN], baseline="off", min_tries=1, explore_share=0.0)
        gate.update(RUN, 50.0, 1.0)  # drafting pays: the gate stays open
        drafter = EagleDrafter(head, settings, costs=COSTS, gate=gate, clock=lambda: now[0])
        drafter.begin(prompt, hidden)
        drafter._catch_up()
        for _ in range(2):
            forwards.clear()
            tree = drafter._grow(budget)
            drafter.cache.drop_scratch()
        depths = depth_list(tree.parents.tolist())
        best = [max(p for p, d in zip(tree.probs, depths) if d == depth) for depth in range(1, max(depths) + 1)]
        return len(forwards), best, drafter.levels.odds

    deep = EagleSettings(top_k=2, expand=2, depth=5, max_nodes=24, min_chance=0.0)
    assert levels(replace(deep, max_nodes=2, adaptive=False))[0] == 1  # depth 2 only
    assert levels(replace(deep, adaptive=False))[0] == 4  # fixed: the whole depth
    grown, best, odds = levels(deep)
    worth = [best[d - 2] * odds[d] >= level for d in range(2, min(len(best) + 2, 6))]  # its expected best child pays
    assert all(worth[:grown])  # each grown level had a parent worth it
    assert grown == 4 or not worth[grown]  # and growth stopped at the first level without one
    if level > 1:
        assert grown == 0  # no guess is likelier than 1: only the root's children, from the catch-up
    elif level > 0.01:
        assert 0 < grown < 4  # this head: best parent times odds 0.04, 0.04, 0.004 at depths 2-4


def test_a_later_answer_starts_from_what_earlier_ones_measured_a_level_to_cost(oracle_eagle):
    """A session builds a drafter per answer; what a tree level costs and offers is kept with its
    sizer and gate. Measured afresh, every answer's first step grew its levels as if they were free
    (SmolLM2's numpy head: 1.3 target forwards at the first step of each answer)."""
    import time

    from backends.core.controller import ONE
    from backends.core.costs import CostModel
    from backends.drafters import DrafterResources, method_spec

    fast = CostModel.from_relative([0.001 * (1 + 0.05 * k) for k in range(25)])  # a target forward: 1 ms
    res = DrafterResources(SamplingSettings(), VOCAB, costs=lambda: fast, head=lambda kind, file: oracle_eagle,
                           embeddings=lambda: embed, offers=frozenset({"head:eagle"}))
    spec = method_spec("eagle2")
    settings = replace(spec.settings(), top_k=2, expand=2, min_chance=0.0)
    first = spec.build(settings, res)
    first.gate.update(ONE, 1.0, 10.0)  # one guess a step lost: its tries are spent, the trees are tried
    forwards, forward = [], first.head.forward

    def dear_forward(feats, tokens, *args, **kwargs):
        forwards.append(len(tokens))
        time.sleep(0.01)  # ten target forwards: no level can pay
        return forward(feats, tokens, *args, **kwargs)

    first.head.forward = dear_forward
    budget = Budget.for_step(TargetLimits(max_batch=64, max_paths=8), room=100, wanted=100)
    prompt = oracle_prompt(5)
    hidden = np.random.default_rng(4).normal(size=(len(prompt) - 1, WIDE)).astype(np.float32)
    first.begin(prompt, hidden)
    first.propose(prompt, budget)
    assert len(forwards) > 1 and first.levels.seconds >= 0.01  # the catch-up, then levels grown blind
    later = spec.build(settings, res)
    assert later.head is first.head and later.levels is first.levels
    forwards.clear()
    later.begin(prompt, hidden)
    later.propose(prompt, budget)
    assert forwards == [len(prompt) - 1]  # the catch-up only


def test_the_one_guess_arm_verifies_the_likeliest_guess_alone_and_grows_nothing(oracle_eagle):
    """Beside sized trees a head's gate plays one guess a step, the catch-up's likeliest token, with
    no tree level run (on 2 CPU cores the cheapest drafting, and the one that paid: SmolLM2 F16's
    EAGLE-3 head 1.09x where sized trees had the gate shut); each arm is scored on its own steps."""
    from backends.core.controller import ONE, RUN, Bandit

    def step(arm: str):
        gate = Bandit([ONE, RUN], baseline="off", min_tries=1, explore_share=0.0)
        gate.update(arm, 50.0, 1.0)  # this arm pays
        gate.update(ONE if arm == RUN else RUN, 1.0, 10.0)  # the other lost
        head = EagleHead(oracle_eagle, embed)
        forwards, forward = [], head.forward

        def counted(feats, tokens, *args, **kwargs):
            forwards.append(len(tokens))
            return forward(feats, tokens, *args, **kwargs)

        head.forward = counted
        drafter = EagleDrafter(head, EagleSettings(min_chance=0.0), costs=COSTS, gate=gate)
        prompt = oracle_prompt(5)
        drafter.begin(prompt, np.random.default_rng(4).normal(size=(len(prompt) - 1, WIDE)).astype(np.float32))
        budget = Budget.for_step(TargetLimits(max_batch=64, max_paths=8), room=100, wanted=100)
        proposal = drafter.propose(prompt, budget)
        return proposal, forwards, drafter

    one, forwards, drafter = step(ONE)
    assert one.size == 1 and list(one.parents) == [-1] and len(forwards) == 1  # the catch-up alone
    assert one.tokens[0] == drafter.head.vocab[int(np.argmax(drafter._frontier[2]))]  # its likeliest token
    tree, forwards, _ = step(RUN)
    assert tree.size > 1 and len(forwards) > 1  # the sized tree grows levels


def test_the_fit_estimator_counts_the_eagle_head_and_its_cache(tmp_path, monkeypatch, smollm_q4_path):
    from backends.drafters import method_spec
    from backends.hardware.fit import trained_head_bytes

    monkeypatch.setenv("SPECDECK_DATA_DIR", str(tmp_path))
    monkeypatch.setattr("backends.heads.files.SHIPPED", tmp_path / "none")
    spec = method_spec("eagle2")
    assert trained_head_bytes(spec, smollm_q4_path, 4096) == 0  # none trained yet
    head, _ = random_head()
    HeadFile("eagle", head.config, ModelFingerprint.of(smollm_q4_path), head.tensors).save(tmp_path / "heads" / "s.eagle")
    weights = (tmp_path / "heads" / "s.eagle.safetensors").stat().st_size
    cache = 4096 * 2 * SHAPE.n_kv_head * SHAPE.head_dim * 4
    assert trained_head_bytes(spec, smollm_q4_path, 4096) == 2 * weights + cache


def test_a_head_could_pay_only_where_verifying_is_cheap_enough():
    from backends.core.planner import could_pay

    chances = [0.35, 0.35 * 0.25]  # a head's held-out agreement per depth, as path chances
    flat = [1.0 + 0.02 * k for k in range(17)]
    steep = [1.0] + [1.86 + 0.1 * k for k in range(16)]
    assert could_pay(chances, flat, lambda depth: 0.05 * depth)
    assert not could_pay(chances, steep, lambda depth: 0.05 * depth)
    assert not could_pay(chances, flat, lambda depth: 1.0 * depth)  # a head as dear as the model


def test_an_answer_the_gate_kept_from_drafting_says_why_with_the_speed_it_measured(oracle_eagle):
    """A head whose drafting lost here drafts nothing, and the answer's stats line says so with the
    measured speed (a user who trained a head sees why tau is 1.00); one that was never shut, or
    runs fixed trees, gives no such reason."""
    from backends.chat import format_stats
    from backends.core.controller import RUN, Bandit

    def answer(gate: Bandit | None, adaptive: bool = True):
        drafter = EagleDrafter(EagleHead(oracle_eagle, embed), EagleSettings(adaptive=adaptive), costs=COSTS, gate=gate)
        oracle = OracleTarget(VOCAB, seed=7, hidden_size=WIDE, n_ctx=2048)
        return list(generate(oracle, drafter, oracle_prompt(5), GenerationSettings(max_new_tokens=40)))[-1]

    lost = Bandit([RUN], baseline="off", min_tries=1, decay=0.99, explore_share=0.0)
    for _ in range(20):
        lost.update(RUN, 1.0, 10.0)  # one token for ten forwards each time it drafted
    shut = answer(lost)
    assert shut.stats.drafted == 0 and list(shut.tokens) == plain_greedy(
        OracleTarget(VOCAB, seed=7, hidden_size=WIDE), oracle_prompt(5), 40, SamplingSettings())
    assert "drafting lost to plain decoding here: 0.10x its speed" in shut.stats.declined
    assert shut.stats.declined in format_stats(shut.stats)
    tried = answer(None)  # a fresh gate tries the head first, so the answer drafts: no reason given
    assert tried.stats.drafted > 0 and tried.stats.declined == ""
    assert answer(lost, adaptive=False).stats.declined == ""


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_a_head_after_prompt_lookup_in_a_cascade_drafts_only_where_the_lookup_found_nothing(oracle_eagle, penalty):
    """``specinfer`` with ``cascade``: prompt lookup first, the head after it. The head runs only on
    steps where the lookup had no guess, yet its cache takes the true state of every position in
    turn (the lookup's steps' too, caught up at its next step), so it drafts from where the text
    is; output equals plain greedy decoding."""
    from backends.drafters.pld import PLDDrafter, PLDSettings
    from backends.drafters.specinfer import SpecInferDrafter

    steps: list[tuple[int, ...]] = []  # per step, each drafter's proposal size
    fed: list[list[int]] = []  # per answer, the positions of the rows the head's cache took

    class Head(EagleDrafter):
        def begin(self, prompt, hidden=None):
            super().begin(prompt, hidden)
            fed.append([])

        def _run_rows(self, pending):
            fed[-1].extend(row[2] for row in pending)
            return super()._run_rows(pending)

    class Watched(SpecInferDrafter):
        def propose(self, context, budget):
            proposal = super().propose(context, budget)
            steps.append(tuple(p.size for p in self._last))
            return proposal

    head = EagleHead(oracle_eagle, embed)
    settings = EagleSettings(top_k=2, expand=2, depth=3, max_nodes=4, adaptive=False)
    accepted = accepted_matching_plain_greedy(
        lambda: Watched([PLDDrafter(PLDSettings(min_ngram=1), costs=COSTS), Head(head, settings, costs=COSTS)],
                        costs=COSTS, cascade=True), method="specinfer", penalty=penalty)
    assert not [s for s in steps if s[0] and s[1]], "both drafted one step"
    assert sum(1 for s in steps if s[0]) > 20 and sum(1 for s in steps if s[1]) > 20, steps
    for positions in filter(None, fed):
        assert positions == list(range(positions[0], positions[0] + len(positions))), positions
    assert accepted > 48


def test_a_cascade_asks_for_no_states_while_its_head_gate_stays_shut(oracle_eagle):
    """Prompt lookup, then a head whose gate found drafting loses: the steps before the head's
    next re-try ask the target for no hidden states, the lookup's steps included (it reads none);
    the output stays plain decoding's."""
    from backends.core.controller import RUN, Bandit
    from backends.drafters.pld import PLDDrafter, PLDSettings
    from backends.drafters.specinfer import SpecInferDrafter

    gate = Bandit([RUN], baseline="off", min_tries=1, decay=0.99, explore_share=0.05)
    for _ in range(20):
        gate.update(RUN, 1.0, 10.0)  # drafting lost here so far: re-tried every ~150 steps
    head = EagleDrafter(EagleHead(oracle_eagle, embed), EagleSettings(), costs=COSTS, gate=gate)
    cascade = SpecInferDrafter([PLDDrafter(PLDSettings(min_ngram=1), costs=COSTS), head], costs=COSTS, cascade=True)
    oracle = OracleTarget(VOCAB, seed=7, hidden_size=WIDE, n_ctx=2048)
    asked, looked_up, verify = [], [], oracle.verify

    def verify_noting(root: int, proposal):
        asked.append(proposal.states)
        looked_up.append(proposal.size > 0 and not proposal.states)
        return verify(root, proposal)

    oracle.verify = verify_noting
    finished = list(generate(oracle, cascade, oracle_prompt(5), GenerationSettings(max_new_tokens=600)))[-1]
    assert list(finished.tokens) == plain_greedy(OracleTarget(VOCAB, seed=7, hidden_size=WIDE), oracle_prompt(5),
                                                 600, SamplingSettings())
    assert asked.count(False) > len(asked) / 2, f"{asked.count(False)} of {len(asked)} steps went without states"
    assert any(looked_up) and finished.stats.drafted > 0


def test_a_head_whose_gate_stays_shut_asks_for_no_states_and_drafts_as_if_it_had(oracle_eagle):
    """While no re-try is due for ``IDLE_ROWS`` steps, a step asks the target for no hidden states
    (llama.cpp's cost about 1% of an F16 forward); the steps before a re-try do, so each re-try
    catches up on exactly those rows and drafts the trees it would have drafted with every state;
    the output stays plain decoding's."""
    import itertools
    from dataclasses import replace

    from backends.core.controller import RUN, Bandit
    from backends.drafters.eagle import IDLE_ROWS

    def run(every_state: bool) -> tuple[list[bool], list[tuple[list[int], int]], list[tuple], tuple[int, ...]]:
        gate = Bandit([RUN], baseline="off", min_tries=1, decay=0.99, explore_share=0.05)
        for _ in range(20):
            gate.update(RUN, 1.0, 10.0)  # drafting lost here so far: re-tried every ~150 steps
        ticks = itertools.count(0.0, 0.002)  # the drafting clock, the same in both runs (a loaded machine's is not)
        drafter = EagleDrafter(EagleHead(oracle_eagle, embed), EagleSettings(), costs=COSTS, gate=gate,
                               clock=lambda: next(ticks))
        oracle = OracleTarget(VOCAB, seed=7, hidden_size=WIDE, n_ctx=2048)
        asked, retries, drafted = [], [], []
        verify, catch_up = oracle.verify, drafter._catch_up

        def verify_noting(root: int, proposal):
            asked.append(proposal.states)
            if proposal.size:
                drafted.append((proposal.tokens, proposal.parents))
            return verify(root, replace(proposal, states=True) if every_state else proposal)

        def caught_up() -> None:
            retries.append(([row[2] for row in drafter._pending], drafter._root))
            catch_up()

        oracle.verify, drafter._catch_up = verify_noting, caught_up
        finished = list(generate(oracle, drafter, oracle_prompt(5), GenerationSettings(max_new_tokens=600)))[-1]
        return asked, retries, drafted, finished.tokens

    asked, retries, drafted, tokens = run(every_state=False)
    assert list(tokens) == plain_greedy(OracleTarget(VOCAB, seed=7, hidden_size=WIDE), oracle_prompt(5), 600,
                                        SamplingSettings())
    assert asked.count(False) > len(asked) / 2, f"{asked.count(False)} of {len(asked)} steps went without states"
    assert len(retries) >= 3 and drafted
    for rows, root in retries:  # the rows right before the root, no older
        assert rows == list(range(root - IDLE_ROWS, root))
    assert run(every_state=True)[2] == drafted  # the same trees as with every state at hand
