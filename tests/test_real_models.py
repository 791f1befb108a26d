"""Tier 2b: every method against plain greedy decoding on real models through llama.cpp.

Batched and one-token evaluation round differently in llama.cpp, so a speculative run may pick
the other token where the target's top two logits are nearly tied. Each divergence is therefore
checked where it happens: the target's top-1 minus top-2 logit gap at the first differing token,
evaluated one token at a time, must lie within the batch noise measured for this model on this
machine (``Session.batch_noise``: F16 and Q4_1 differ tenfold). Anything else is a bug.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from backends.bench import logit_margin
from backends.core.types import Finished, GenerationSettings, Proposal, SamplingSettings
from tests.conftest import PROMPTS

# Fixed lengths: the controller may rightly decide drafting does not pay on this CPU, but these
# tests must exercise verification and rollback on every step.
METHODS = [
    ("pld", {"adaptive": False}),
    ("draft", {"adaptive": False}),
    ("draft", {"adaptive": False, "tree_width": 3, "min_confidence": 0.0, "max_draft": 4}),
]
GREEDY = GenerationSettings(max_new_tokens=40, sampling=SamplingSettings())


def answer(session, method, prompt_tokens, settings=None) -> Finished:
    session.reset()
    events = list(session.generate(method, prompt_tokens, GREEDY, method_settings=settings or {}))
    return events[-1]


def same_or_near_tie(session, method: str, prompt: list[int], got: Finished, ref: Finished) -> bool:
    """True when ``got`` is plain greedy's ``ref``; False when it parts from it at a measured near-tie
    of the target's logits; anything else fails the test."""
    if got.tokens == ref.tokens:
        return True
    i = next((j for j, (a, b) in enumerate(zip(got.tokens, ref.tokens)) if a != b), None)
    assert i is not None, f"{method}: one output is a prefix of the other: {got.text!r} vs {ref.text!r}"
    margin, top1, top2 = logit_margin(session, prompt + list(ref.tokens[:i]), GREEDY.sampling)
    near_tie = session.batch_noise().threshold
    assert margin <= near_tie, f"{method} diverged at token {i} beyond this model's batch noise ({margin:.3f} > {near_tie:.3f})"
    assert {got.tokens[i], ref.tokens[i]} == {top1, top2}
    return False


def check_method_matches_ar(session, method, settings):
    exact, speculated = 0, 0
    for text in PROMPTS:
        prompt = session.model.chat_prompt([{"role": "user", "content": text}])
        ref = answer(session, "ar", prompt)
        got = answer(session, method, prompt, settings)
        speculated += got.stats.accepted
        exact += same_or_near_tie(session, method, prompt, got, ref)
    assert exact >= len(PROMPTS) - 3, f"{method}: only {exact} of {len(PROMPTS)} outputs identical"
    assert speculated > 0, f"{method} never had a draft accepted"


@pytest.mark.parametrize("method,settings", METHODS, ids=["pld", "draft", "draft-tree"])
def test_smollm2_f16_matches_plain_greedy(smollm_session, method, settings):
    check_method_matches_ar(smollm_session, method, settings)


@pytest.mark.parametrize("method,settings", METHODS, ids=["pld", "draft", "draft-tree"])
def test_gemma_matches_plain_greedy(gemma_session, method, settings):
    check_method_matches_ar(gemma_session, method, settings)


@pytest.mark.parametrize("width", [1, 3], ids=["chain", "tree"])
def test_smollm2_medusa_with_the_shipped_head_matches_plain_greedy(smollm_session, width):
    """The shipped head reads llama.cpp's hidden states; every guess is verified (fixed tree size)."""
    check_method_matches_ar(smollm_session, "medusa", {"adaptive": False, "width": width, "max_nodes": 6})


@pytest.mark.parametrize("top_k", [1, 3], ids=["chain", "tree"])
def test_smollm2_eagle2_with_the_shipped_head_matches_plain_greedy(smollm_session, top_k):
    """The shipped EAGLE head runs on llama.cpp's hidden states and the GGUF's own embeddings;
    every tree is verified (fixed size), so losslessness is tested on every step."""
    check_method_matches_ar(smollm_session, "eagle2",
                            {"adaptive": False, "top_k": top_k, "expand": top_k, "depth": 4, "max_nodes": 8})


@pytest.mark.parametrize("cascade", [False, True], ids=["merged", "cascade"])
@pytest.mark.parametrize("head", ["eagle3-native", "medusa"])
def test_smollm2_a_head_merged_with_prompt_lookup_reads_the_state_of_every_token(smollm_session, head, cascade):
    """``specinfer`` merging prompt lookup with a trained head: where prompt lookup's nodes are
    accepted past the head's own, the head must still read those tokens' states (llama.cpp's
    EAGLE-3 chain refused the gap mid-answer: "rows must continue the cache"; Medusa drafted from a
    stale state). With ``cascade`` the head does not run at all on prompt lookup's steps and
    catches up on their states later. Every tree is verified whole (fixed sizes); outputs equal
    plain greedy's."""
    check_method_matches_ar(smollm_session, "specinfer", {"drafters": f"pld,{head}", "adaptive": False,
                                                          "cascade": cascade})


def test_smollm2_eagle2_sampling_keeps_the_model_distribution(smollm_session):
    """Sampling through the engine with the shipped head's trees: the first answer token follows
    SmolLM2's own distribution, and so does the second after the likeliest first (read from the
    model's logits one token at a time). No top-k/top-p/min-p cut, so no token sits at a cut-off
    where batched and one-token rounding could move it across."""
    from backends.core.sampling import target_distribution
    from tests.test_eagle import chi_square

    session = smollm_session
    prompt = session.model.chat_prompt([{"role": "user", "content": "Count from 1 to 5."}])
    sampling = SamplingSettings(temperature=0.6, top_k=0, top_p=1.0, min_p=0.0)

    def p(context: list[int]) -> np.ndarray:
        session.reset()
        session.target.prefill(context[:-1])
        row = np.array(session.target.verify(context[-1], Proposal()).row(0))
        session.reset()
        return target_distribution(row, context, sampling)

    p1 = p(prompt)
    first = int(np.argmax(p1))
    p2 = p(prompt + [first])
    counts = np.zeros((2, len(p1)))
    accepted = 0
    for seed in range(300):
        session.reset()
        done = list(session.generate("eagle2", prompt, GenerationSettings(max_new_tokens=2, sampling=replace(sampling, seed=seed)),
                                     method_settings={"adaptive": False, "top_k": 3, "expand": 2, "depth": 3,
                                                      "max_nodes": 8}))[-1]
        counts[0, done.tokens[0]] += 1
        if done.tokens[0] == first:
            counts[1, done.tokens[1]] += 1
        accepted += done.stats.accepted
    assert accepted > 20, f"only {accepted} guesses accepted: the trees were not exercised"
    assert counts[1].sum() > 120, "the likeliest first token came too rarely to test the second"
    for k, exact in enumerate((p1, p2)):
        chi2, dof = chi_square(counts[k], exact)
        assert chi2 < dof + 5 * np.sqrt(2 * dof) + 5, f"token {k + 1}: chi2 {chi2:.1f} for {dof} degrees of freedom"


def test_tree_verify_matches_chains_and_commit_keeps_the_path(smollm_session):
    """One llama_decode over a tree gives each node the logits of its own path, and committing a
    path that is not sequence 0 leaves exactly that path in the cache."""
    from backends.core.types import Proposal, Verdict

    session = smollm_session
    target = session.target
    prompt = session.model.chat_prompt([{"role": "user", "content": "Name a fruit."}])
    a, b, c, d = session.model.tokenize(" apple banana cherry date", add_special=False)[:4]
    tree = Proposal(tokens=(a, b, c, d, b), parents=(-1, 0, -1, 2, 3))  # paths: a-b, c-d-b
    target.reset()
    target.prefill(prompt[:-1])
    out = target.verify(prompt[-1], tree)
    rows = {node: out.row(node + 1) for node in (1, 4)}  # copies: the next decode overwrites out's buffer
    for node, path in {1: [a, b], 4: [c, d, b]}.items():
        target.reset()
        target.prefill(prompt[:-1])
        chain = target.verify(prompt[-1], Proposal.chain(path)).row(len(path))
        assert int(rows[node].argmax()) == int(chain.argmax())
        assert abs(rows[node] - chain).max() < 0.5
    target.reset()
    target.prefill(prompt[:-1])
    target.verify(prompt[-1], tree)
    target.commit(Verdict(path=(2, 3), tokens=(c, d, 7), drafted=5, draft_depth=3))
    assert target.cached_tokens == tuple(prompt) + (c, d)
    after = target.verify(7, Proposal()).row(0)
    target.reset()
    target.prefill(list(prompt) + [c, d])
    fresh = target.verify(7, Proposal()).row(0)
    assert abs(after - fresh).max() < 0.5 and int(after.argmax()) == int(fresh.argmax())
    target.reset()


def test_cost_curve_reaches_64_node_trees(smollm_session):
    # the controller sizes merged and retrieval trees of up to 64 nodes from this curve: trees must
    # be measured (through the tree path of the backend), not extrapolated from chains of 16
    from backends.core.timing import probe_sizes, time_forwards

    target = smollm_session.target
    smollm_session.reset()
    curve = time_forwards(target, 64, reps=1, context=64)
    assert len(curve) == 65 and all(s > 0 for s in curve)
    assert 32 in probe_sizes(64)
    assert curve[64] > curve[16] > curve[0]  # a CPU pays for every extra node
    assert target.n_past == 0  # the probes leave nothing behind
    assert answer(smollm_session, "ar", [1, 2, 3]).stats.new_tokens > 0  # and the target still answers


def test_the_first_long_prompt_measures_the_cost_curve_at_its_length(smollm_q4_path, tmp_path, monkeypatch):
    # at load the curve is measured after a short filler context only; the first prompt of
    # LONG_CONTEXT tokens adds one at its own length, on top of its prefilled cache, without
    # changing the answer, and the cache file keeps both for the next session
    import backends.factory as factory
    from backends.core.types import Prefilled
    from backends.factory import Session, SessionConfig
    from backends.models.cost_cache import LONG_CONTEXT

    monkeypatch.setenv("SPECDECK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(factory, "QUIET_CORES", float("inf"))  # keep the curves however busy the machine is
    with Session(SessionConfig(model=str(smollm_q4_path), n_ctx=1024)) as session:
        costs = session.cost_model()
        assert len(costs.contexts) == 1 and costs.contexts[0] < LONG_CONTEXT
        short = answer(session, "pld", list(range(200, 300)))
        assert costs.contexts == costs.contexts[:1]  # a short prompt measures nothing more
        prompt = session.model.tokenize(" ".join(["the quick brown fox jumps over the lazy dog"] * 80))[:600]
        first = list(session.generate("ar", prompt, GREEDY))
        assert costs.contexts[1] == len(prompt) - 1  # measured on the prompt's own cache
        assert isinstance(first[0], Prefilled) and first[-1].stats.reused_tokens == 0
        assert first[-1].tokens == answer(session, "ar", prompt).tokens  # the probes left nothing behind
        assert short.stats.new_tokens > 0
    with Session(SessionConfig(model=str(smollm_q4_path), n_ctx=1024)) as again:
        assert again.cost_model().contexts == costs.contexts  # both loaded, nothing measured


# --- issue 16 section 4 on llama.cpp: rollback failures, limits, prefill Stop, logits ownership --------
def _prompt(session, text="Name a fruit."):
    return session.model.chat_prompt([{"role": "user", "content": text}])


def test_a_removal_llama_cpp_refuses_raises_instead_of_starting_over(smollm_session, monkeypatch):
    """Before: ``truncate`` fell back to ``reset()`` without a word and ``commit`` ignored
    ``seq_rm``'s answer, so the next step ran on a cache that was not the text."""
    import llama_cpp

    from backends.core.errors import BackendError
    from backends.core.types import Proposal, Verdict

    target = smollm_session.target
    prompt = _prompt(smollm_session)
    target.reset()
    target.prefill(prompt)
    monkeypatch.setattr(llama_cpp, "llama_memory_seq_rm", lambda *args: False)
    with pytest.raises(BackendError, match="roll its cache back"):
        target.truncate(len(prompt) - 3)
    assert target.n_past == 0  # emptied, and said so: nothing runs on a cache that is not the text
    monkeypatch.undo()
    target.prefill(prompt[:-1])
    target.verify(prompt[-1], Proposal.chain([1, 2, 3]))
    monkeypatch.setattr(llama_cpp, "llama_memory_seq_rm", lambda *args: False)
    with pytest.raises(BackendError, match="rejected tokens"):
        target.commit(Verdict(path=(0,), tokens=(1, 5), drafted=3, draft_depth=3))
    monkeypatch.undo()
    target.reset()


def test_a_recurrent_model_is_offered_plain_decoding_only_and_told_why(smollm_session, monkeypatch):
    from backends.core.errors import SpecDeckError
    from backends.core.types import HIDDEN_STATES, LAYER_STATES, NATIVE_EAGLE3, ROLLBACK, SEQUENCES, TREE
    from backends.llamacpp.target import LlamaTarget

    model = smollm_session.model
    transformer = {TREE, ROLLBACK, HIDDEN_STATES, SEQUENCES}
    assert LlamaTarget.offers == transformer
    assert smollm_session.target.offers == transformer | {LAYER_STATES, NATIVE_EAGLE3}  # a llama graph also hands out layer inputs and runs EAGLE-3 heads
    monkeypatch.setitem(model.__dict__, "is_recurrent", True)  # what llama_model_is_recurrent says of Mamba
    recurrent = LlamaTarget(model, n_ctx=256)
    try:
        assert recurrent.offers == frozenset()
        monkeypatch.setattr(smollm_session, "target", recurrent)
        # timing probes roll back; on such a model they would fail before the reason is given
        monkeypatch.setattr(smollm_session, "cost_model", lambda: pytest.fail("probed a model that cannot roll back"))
        for method in ("pld", "draft", "auto", "medusa"):
            with pytest.raises(SpecDeckError, match="cannot run on .* whose cache can forget rejected guesses"):
                smollm_session.drafter(method, GREEDY.sampling)
        smollm_session.drafter("ar", GREEDY.sampling)  # plain decoding stays exact on such models
    finally:
        recurrent.close()


def test_a_prefix_the_sliding_window_no_longer_holds_is_computed_again(gemma_session, monkeypatch):
    """Gemma 3 attends over a 512-token window in most layers, and llama.cpp may reuse the cells
    behind it. ``seq_rm`` still succeeds then, so before, a prompt sharing an early prefix with
    the cached one reused it without the window behind it. The cache's lowest position says
    whether the window is there (simulated here: llama.cpp keeps it at this size)."""
    import llama_cpp

    from backends.core.errors import BackendError

    target = gemma_session.target
    assert gemma_session.model.n_swa > 0
    tokens = gemma_session.model.tokenize(" ".join(f"item {i} is {i * 7 % 13}." for i in range(60)))[:300]
    target.reset()
    target.prefill(tokens)
    monkeypatch.setattr(llama_cpp, "llama_memory_seq_pos_min", lambda mem, seq: 250)  # cells below 250 reused
    assert target.prefill(tokens[:200] + [5, 6]) == 0 and target.cached_tokens == tuple(tokens[:200] + [5, 6])
    with pytest.raises(BackendError, match="roll its cache back"):
        target.truncate(100)
    monkeypatch.undo()
    target.prefill(tokens)
    target.truncate(290)  # a rollback within the window is exact and allowed
    assert target.n_past == 290
    target.reset()


def test_targets_declare_their_limits_and_a_wide_draft_tree_fits_them(smollm_session):
    """max_draft 8 with tree_width 8 makes 57 leaves; the context has 32 sequences."""
    target = smollm_session.target
    assert (target.limits.max_batch, target.limits.max_paths) == (target.n_batch, target.max_tree_paths) == (512, 32)
    prompt = _prompt(smollm_session, "Count from one to twenty.")
    ref = answer(smollm_session, "ar", prompt)
    wide = answer(smollm_session, "draft", prompt,
                  {"adaptive": False, "tree_width": 8, "max_draft": 8, "min_confidence": 0.0})
    assert wide.stats.drafted > 0 and len(wide.tokens) == len(ref.tokens)


def test_the_draft_context_is_as_long_as_the_targets(smollm_f16_path, smollm_q4_path, monkeypatch):
    """A draft model trained on a shorter context used to get a shorter context than the target,
    and a long prompt the target took failed in the draft's prefill."""
    import backends.factory as factory

    class ShortTrained(factory.LlamaModel):
        def __init__(self, path, **kw):
            super().__init__(path, **kw)
            if str(path) == str(smollm_q4_path):
                self.n_ctx_train = 256

    monkeypatch.setattr(factory, "LlamaModel", ShortTrained)
    with factory.Session(factory.SessionConfig(model=str(smollm_f16_path), draft_model=str(smollm_q4_path),
                                               n_ctx=1024)) as session:
        assert session.draft_target.n_ctx == session.target.n_ctx == 1024
        prompt = session.model.tokenize(" ".join(["one two three four"] * 100))[:400]
        finished = answer(session, "draft", prompt, {"adaptive": False})
        assert finished.stats.new_tokens > 0


def test_a_long_prefill_stops_between_chunks(smollm_q4_path):
    from backends.core.errors import Cancelled
    from backends.llamacpp.model import LlamaModel
    from backends.llamacpp.target import LlamaTarget

    with LlamaModel(smollm_q4_path) as model:
        target = LlamaTarget(model, n_ctx=1024, n_batch=128)
        asked = []
        tokens = model.tokenize(" ".join(["the quick brown fox"] * 100))[:400]
        with pytest.raises(Cancelled):
            target.prefill(tokens, stop=lambda: asked.append(1) or len(asked) > 2)
        assert target.n_past == 256 and target.cached_tokens == tuple(tokens[:256])  # two chunks, kept
        assert target.prefill(tokens) == 256  # the next prefill goes on from there
        target.close()


def test_verify_hands_out_llama_cpp_buffer_read_only_and_says_when_it_is_stale(smollm_session):
    """No [n_nodes, vocab] copy per step: the logits are llama.cpp's own buffer, valid until the
    next decode, after which reading them raises instead of returning another forward's numbers."""
    from backends.core.types import Proposal, StaleLogitsError, Verdict

    target = smollm_session.target
    prompt = _prompt(smollm_session)
    target.reset()
    target.prefill(prompt[:-1])
    out = target.verify(prompt[-1], Proposal.chain([1, 2, 3]))
    assert not out.logits.flags.owndata and not out.logits.flags.writeable
    kept, top = out.row(0), out.top(0)
    assert int(kept.argmax()) == top and list(out.argmax()) == [int(out.logits[i].argmax()) for i in range(4)]
    target.commit(Verdict(path=(), tokens=(top,), drafted=3, draft_depth=3))
    target.verify(top, Proposal())
    with pytest.raises(StaleLogitsError):
        out.row(0)
    assert int(kept.argmax()) == top  # the copy taken in time is still good
    target.reset()


def test_the_terminal_chat_leaves_out_turns_that_no_longer_fit(smollm_session):
    """The desktop chat already did; the terminal chat failed with "the prompt has N tokens"."""
    import io

    from backends.chat import ChatState, answer as chat_answer

    long_turn = "Here is some text to remember: " + " ".join(f"fact {i} is {i * 3}." for i in range(120))
    state = ChatState(method="ar")
    for _ in range(4):
        state.messages += [{"role": "user", "content": long_turn}, {"role": "assistant", "content": "Noted."}]
    state.messages.append({"role": "user", "content": "What is fact 2?"})
    assert len(smollm_session.model.chat_prompt(state.conversation())) > smollm_session.target.n_ctx
    out = io.StringIO()
    stats = chat_answer(smollm_session, state, GenerationSettings(max_new_tokens=8), out)
    assert stats is not None and stats.new_tokens > 0
    assert "oldest message(s) no longer fit" in out.getvalue()
    assert len(state.messages) == 10  # the conversation keeps every turn; only the prompt leaves some out
