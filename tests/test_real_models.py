"""Tier 2b: every method against plain greedy decoding on real models through llama.cpp.

Batched and one-token evaluation round differently in llama.cpp, so a speculative run may pick
the other token where the target's top two logits are nearly tied. Each divergence is therefore
checked where it happens: the target's top-1 minus top-2 logit gap at the first differing token,
evaluated one token at a time, must be tiny. Anything else is a bug.
"""

from __future__ import annotations

import pytest

from backends.bench import logit_margin
from backends.core.types import Finished, GenerationSettings, SamplingSettings
from tests.conftest import PROMPTS

NEAR_TIE = 0.5  # logits; F16 batched-vs-single differences measured here stay far below this
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


def check_method_matches_ar(session, method, settings):
    exact, speculated = 0, 0
    for text in PROMPTS:
        prompt = session.model.chat_prompt([{"role": "user", "content": text}])
        ref = answer(session, "ar", prompt)
        got = answer(session, method, prompt, settings)
        speculated += got.stats.accepted
        if got.tokens == ref.tokens:
            exact += 1
            continue
        i = next((j for j, (a, b) in enumerate(zip(got.tokens, ref.tokens)) if a != b), None)
        assert i is not None, f"{method}: one output is a prefix of the other: {got.text!r} vs {ref.text!r}"
        margin, top1, top2 = logit_margin(session, prompt + list(ref.tokens[:i]), GREEDY.sampling)
        assert margin < NEAR_TIE, f"{method} diverged at token {i} where the target was not near a tie ({margin:.3f})"
        assert {got.tokens[i], ref.tokens[i]} == {top1, top2}
    assert exact >= len(PROMPTS) - 3, f"{method}: only {exact} of {len(PROMPTS)} outputs identical"
    assert speculated > 0, f"{method} never had a draft accepted"


@pytest.mark.parametrize("method,settings", METHODS, ids=["pld", "draft", "draft-tree"])
def test_smollm2_f16_matches_plain_greedy(smollm_session, method, settings):
    check_method_matches_ar(smollm_session, method, settings)


@pytest.mark.parametrize("method,settings", METHODS, ids=["pld", "draft", "draft-tree"])
def test_gemma_matches_plain_greedy(gemma_session, method, settings):
    check_method_matches_ar(gemma_session, method, settings)


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
    for node, path in {1: [a, b], 4: [c, d, b]}.items():
        target.reset()
        target.prefill(prompt[:-1])
        chain = target.verify(prompt[-1], Proposal.chain(path)).logits[-1]
        assert int(out.logits[node + 1].argmax()) == int(chain.argmax())
        assert abs(out.logits[node + 1] - chain).max() < 0.5
    target.reset()
    target.prefill(prompt[:-1])
    target.verify(prompt[-1], tree)
    target.commit(Verdict(path=(2, 3), tokens=(c, d, 7), drafted=5, draft_depth=3))
    assert target.cached_tokens == tuple(prompt) + (c, d)
    after = target.verify(7, Proposal()).logits[0]
    target.reset()
    target.prefill(list(prompt) + [c, d])
    fresh = target.verify(7, Proposal()).logits[0]
    assert abs(after - fresh).max() < 0.5 and int(after.argmax()) == int(fresh.argmax())
    target.reset()


def test_cost_curve_reaches_64_node_trees(smollm_session):
    # the controller sizes merged and retrieval trees of up to 64 nodes from this curve: trees must
    # be measured (through the tree path of the backend), not extrapolated from chains of 16
    from backends.core.costs import probe_sizes, time_forwards

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
