"""The engine's bookkeeping defects of issue 16 (section 4), each pinned on the exact oracle.

a. a costly sub-drafter whose gate kept it from drafting must stay in step: the draft model's
   cache plus the tokens waiting for it must be the context after every step;
b. a draft model's backlog longer than its batch is caught up in chunks, with one logits row;
c. trees are cut to the target's sequence and batch limits before they reach it;
d. a rollback that fails stops the answer with an error instead of diverging silently;
e. a draft context shorter than the prompt, tokens cut after EOS or a stop string, a conversation
   that outgrows the context, Stop during a long prefill;
f. logits are read in place, and a stale view says so; REST builds only the trie nodes it can use.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from backends.core.controller import RUN, Bandit
from backends.core.errors import BackendError
from backends.core.engine import generate
from backends.core.sampling import greedy_token
from backends.core.protocols import Drafter
from backends.core.types import (
    Budget,
    Finished,
    GenerationSettings,
    Proposal,
    SamplingSettings,
    StaleLogitsError,
    Step,
    TargetOutput,
)
from backends.drafters.draft_model import DraftModelDrafter, DraftSettings
from backends.drafters.lookahead import LookaheadDrafter, LookaheadSettings
from backends.drafters.pld import PLDDrafter, PLDSettings
from backends.drafters.rest import RESTDrafter, RESTSettings
from backends.drafters.specinfer import SpecInferDrafter
from tests.oracle import OracleTarget
from tests.test_engine import CHEAP_DRAFT, COSTS, OracleTreeDrafter, plain_greedy, run
from tests.test_rest import _oracle_store

GREEDY = SamplingSettings()


class Scripted(Bandit):
    """A gate's record that opens on the steps a test says (``runs(step)``), whatever was measured."""

    def __init__(self, runs) -> None:
        super().__init__([RUN], baseline="off")
        self.runs, self.steps = runs, 0

    def choose(self):
        self.steps += 1
        return RUN if self.runs(self.steps) else "off"


def _draft(oracle: OracleTarget, seed: int, **kw) -> tuple[DraftModelDrafter, OracleTarget]:
    batch = kw.pop("batch", 512)
    gate = kw.pop("gate", None)
    draft_oracle = OracleTarget(oracle.n_vocab, seed=seed, perturb=1.5, perturb_seed=seed + 100,
                                n_ctx=kw.pop("n_ctx", oracle.n_ctx), max_batch=batch)
    settings = DraftSettings(**{"min_confidence": 0.2, **kw})
    drafter = DraftModelDrafter(draft_oracle, settings, sampling=GREEDY, target_vocab=oracle.n_vocab,
                                costs=COSTS, draft_costs=CHEAP_DRAFT, gate=gate)
    return drafter, draft_oracle


def _quoting_prompt(seed: int) -> list[int]:
    """A passage and then its start again: prompt lookup is confident for a long stretch."""
    passage = np.random.default_rng(seed).integers(0, 32, size=40).tolist()
    return passage + passage[:6]


# --- a. specinfer and a draft model that sits steps out ------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_a_draft_model_that_sits_steps_out_stays_in_step_with_the_text(seed):
    """pld + draft, the draft's gate open every third step only. A draft that did not draft still
    gets the verdict and must queue what the step emitted, not cut its cache back to a stale base
    (before the fix of issue 16 10 of 120 steps were out of step)."""
    oracle = OracleTarget(32, seed=seed)
    draft, draft_oracle = _draft(oracle, seed, gate=Scripted(lambda step: step % 3 == 0))
    merged = SpecInferDrafter([draft, PLDDrafter(PLDSettings(adaptive=False), costs=COSTS)], costs=COSTS)
    drafted = []
    propose = draft.propose
    draft.propose = lambda *a, **kw: (p := propose(*a, **kw), drafted.append(p.size > 0))[0]
    prompt = _quoting_prompt(seed)
    context, out_of_step = list(prompt), 0
    for event in generate(oracle, merged, prompt, GenerationSettings(max_new_tokens=120)):
        if isinstance(event, Step):
            context.extend(event.tokens)
            out_of_step += draft_oracle.tokens + draft._pending != context
        elif isinstance(event, Finished):
            assert list(event.tokens) == plain_greedy(oracle, prompt, 120, GREEDY)
    assert any(drafted) and not all(drafted), "the scenario needs steps with and without the draft model"
    assert out_of_step == 0


def test_the_gate_books_every_datastore_lookup_once(tmp_path):
    """REST inside specinfer: the gate scores each step that looked up, once, and no other (a step
    without a lookup once re-booked the last one)."""
    oracle = OracleTarget(32, seed=2)
    store = _oracle_store(tmp_path, oracle, 2, GREEDY)
    rest = RESTDrafter(store, RESTSettings(min_match=1, conversation=False), costs=COSTS)
    lookups = []
    lookup = rest.lookup
    rest.lookup = lambda *a, **kw: lookups.append(1) or lookup(*a, **kw)
    booked = []
    update = rest.gate.update
    rest.gate.update = lambda *a, **kw: booked.append(1) or update(*a, **kw)
    merged = SpecInferDrafter([rest, PLDDrafter(PLDSettings(adaptive=False), costs=COSTS)], costs=COSTS)
    run(oracle, merged, _quoting_prompt(2), GenerationSettings(max_new_tokens=100))
    assert len(booked) == len(lookups) > 0


# --- b. the draft model's catch-up ----------------------------------------------------------------


def test_a_backlog_longer_than_the_draft_batch_is_caught_up_in_chunks():
    """The draft model's gate keeps it off for 20 steps (as when drafting lost lately), and its
    backlog outgrows a batch of 8 tokens. Before the fix its catch-up was one verify of the whole
    backlog and raised mid-answer."""
    for seed in range(4):
        oracle = OracleTarget(32, seed=seed)
        draft, draft_oracle = _draft(oracle, seed, batch=8, gate=Scripted(lambda step: step > 20))
        caught_up = []
        extend = draft_oracle.extend
        draft_oracle.extend = lambda tokens: caught_up.append(len(tokens)) or extend(tokens)
        merged = SpecInferDrafter([draft, PLDDrafter(costs=COSTS)], costs=COSTS)
        prompt = [seed, 1, 2, 3]
        finished = run(oracle, merged, prompt, GenerationSettings(max_new_tokens=80))
        assert list(finished.tokens) == plain_greedy(oracle, prompt, 80, GREEDY)
        assert max(caught_up) > 20 and draft_oracle.tokens[: len(prompt) + 20] == prompt + list(finished.tokens[:20])


def test_a_catch_up_asks_for_the_last_row_only():
    oracle = OracleTarget(32, seed=1)
    draft, draft_oracle = _draft(oracle, 1, adaptive=False, batch=8, max_draft=1)
    prompt = list(range(10))
    draft.begin(prompt)
    backlog = list(range(10, 31))  # 21 tokens the draft has not seen, and the root
    draft._pending.extend(backlog)
    rows = []
    verify, extend = draft_oracle.verify, draft_oracle.extend
    draft_oracle.verify = lambda root, p: rows.append(1 + p.size) or verify(root, p)
    draft_oracle.extend = lambda tokens: rows.append(1) or extend(tokens)
    proposal = draft.propose(prompt + backlog, Budget(max_nodes=8, max_depth=8))
    assert proposal.size == 1 and draft_oracle.tokens == prompt + backlog
    assert rows == [1]  # one row of logits, not 22
    assert draft_oracle.forwards == 2 + 3  # 9 prompt tokens, then 22 to catch up, in batches of 8


# --- c. trees within the target's limits -----------------------------------------------------------


def test_a_proposal_is_cut_to_the_targets_sequence_limit():
    chain_with_leaves = Proposal((1, 2, 3, 4, 5, 6), (-1, -1, -1, 0, 0, 3))
    cut = chain_with_leaves.pruned(Budget(max_nodes=64, max_depth=64, max_paths=2))
    assert cut.tokens == (1, 2, 4, 6)  # the chain through 1 survives, one more leaf beside it
    assert chain_with_leaves.kept(Budget(max_nodes=64, max_depth=64, max_paths=1)) == [0, 3, 5]
    assert Proposal.chain([1, 2, 3]).pruned(Budget(max_nodes=64, max_depth=64, max_paths=1)).size == 3


def test_the_budget_carries_the_targets_limits():
    seen = []

    class Recording(OracleTreeDrafter):
        def propose(self, context, budget):
            seen.append(budget)
            return super().propose(context, budget)

    oracle = OracleTarget(32, seed=0, max_batch=6, max_paths=3)
    prompt = [1, 2, 3]
    finished = run(oracle, Recording(oracle, 0, GREEDY), prompt, GenerationSettings(max_new_tokens=40))
    assert list(finished.tokens) == plain_greedy(oracle, prompt, 40, GREEDY)
    assert all(b.max_nodes <= 5 and b.max_paths == 3 for b in seen)


def test_a_wide_draft_tree_fits_the_sequence_limit():
    """max_draft 8 and tree_width 8 make 57 leaves; llama.cpp holds 32 sequences."""
    oracle = OracleTarget(32, seed=5)
    draft, _ = _draft(oracle, 5, adaptive=False, tree_width=8, max_draft=8, min_confidence=0.0)
    prompt = [4, 8, 15, 16, 23, 4, 8]
    finished = run(oracle, draft, prompt, GenerationSettings(max_new_tokens=48))
    assert list(finished.tokens) == plain_greedy(oracle, prompt, 48, GREEDY)
    assert finished.stats.drafted > 48


@pytest.mark.parametrize("method", ["random-tree", "draft-tree", "specinfer", "rest", "lookahead"])
def test_every_tree_method_stays_within_two_sequences(tmp_path, method):
    for seed in range(4):
        oracle = OracleTarget(32, seed=seed, max_paths=2, max_batch=12)
        if method == "random-tree":
            drafter = OracleTreeDrafter(oracle, seed, GREEDY)
        elif method == "draft-tree":
            drafter = _draft(oracle, seed, tree_width=4, adaptive=False)[0]
        elif method == "specinfer":
            wide = _draft(oracle, seed, tree_width=3, adaptive=False)[0]
            drafter = SpecInferDrafter([wide, PLDDrafter(PLDSettings(adaptive=False), costs=COSTS)], costs=COSTS)
        elif method == "rest":
            store = _oracle_store(tmp_path, oracle, seed, GREEDY)
            drafter = RESTDrafter(store, RESTSettings(min_match=1, adaptive=False, max_nodes=64, conversation=False),
                                  costs=COSTS)
        else:
            drafter = LookaheadDrafter(LookaheadSettings(adaptive=False, guesses=8), costs=COSTS)
        prompt = np.random.default_rng(seed).integers(0, 32, size=20).tolist()
        finished = run(oracle, drafter, prompt, GenerationSettings(max_new_tokens=40))
        assert list(finished.tokens) == plain_greedy(oracle, prompt, 40, GREEDY), f"{method} seed {seed}"


# --- d. failed rollbacks -----------------------------------------------------------------------------


class StickyOracle(OracleTarget):
    """A target whose cache cannot drop what it decoded (what a recurrent state does): every
    verified node stays, accepted or not, and it says nothing about it."""

    def commit(self, verdict):
        root, tokens = self._pending
        self._pending = None
        self.tokens.append(root)
        self.tokens.extend(tokens)


def test_a_rollback_that_did_not_happen_stops_the_answer():
    oracle = StickyOracle(32, seed=3)
    with pytest.raises(BackendError, match="rollback"):
        run(oracle, PLDDrafter(PLDSettings(adaptive=False), costs=COSTS), _quoting_prompt(3),
            GenerationSettings(max_new_tokens=60))


def test_targets_that_cannot_roll_back_offer_no_speculation():
    from backends.core.types import HIDDEN_STATES, ROLLBACK, SEQUENCES, TREE
    from backends.llamacpp.target import offers_for

    assert offers_for(recurrent=False, hybrid=False) == {TREE, ROLLBACK, HIDDEN_STATES, SEQUENCES}
    assert offers_for(recurrent=True, hybrid=False) == frozenset()
    assert offers_for(recurrent=False, hybrid=True) == frozenset()
    assert ROLLBACK in PLDDrafter().requires and ROLLBACK in _draft(OracleTarget(), 0)[0].requires


# --- e. smaller defects --------------------------------------------------------------------------------


def test_a_draft_context_shorter_than_the_prompt_drafts_nothing_instead_of_failing():
    oracle = OracleTarget(32, seed=1)
    draft, _ = _draft(oracle, 1, n_ctx=32)
    prompt = np.random.default_rng(1).integers(0, 32, size=60).tolist()
    finished = run(oracle, draft, prompt, GenerationSettings(max_new_tokens=30))
    assert list(finished.tokens) == plain_greedy(oracle, prompt, 30, GREEDY)
    assert finished.stats.drafted == 0


class Clairvoyant(Drafter):
    """Proposes the target's own greedy continuation, 8 tokens deep: everything is accepted."""

    requires = frozenset()

    def __init__(self, oracle: OracleTarget) -> None:
        self.oracle = oracle

    def begin(self, prompt, hidden=None):
        pass

    def propose(self, context, budget):
        ctx = list(context)
        for _ in range(min(8, budget.max_depth, budget.max_nodes)):
            ctx.append(greedy_token(self.oracle.logits_for(ctx), ctx, GREEDY))
        return Proposal.chain(ctx[len(context):])

    def observe(self, out, verdict):
        pass


def test_tokens_cut_after_eos_are_not_counted_as_accepted():
    oracle = OracleTarget(32, seed=0, eos=5, eos_bias=1.0)
    events = list(generate(oracle, Clairvoyant(oracle), [1, 2, 3], GenerationSettings(max_new_tokens=400)))
    finished = events[-1]
    assert finished.reason == "eos" and finished.tokens[-1] == 5
    steps = [e for e in events if isinstance(e, Step)]
    assert finished.stats.accepted == sum(s.accepted for s in steps) == sum(finished.stats.accepted_at)
    assert finished.stats.accepted <= finished.stats.new_tokens - finished.stats.forwards + 1  # no bonus after EOS


def test_tokens_past_a_stop_string_are_not_part_of_the_answer():
    oracle = OracleTarget(32, seed=2)
    prompt = [1, 2, 3]
    full = run(oracle, Clairvoyant(oracle), prompt, GenerationSettings(max_new_tokens=40))
    pieces = [oracle.token_piece(t).decode() for t in full.tokens]
    stop = pieces[10] + pieces[11]  # completed by the 12th token, which an 8-token step carries past
    cut = run(oracle, Clairvoyant(oracle), prompt, GenerationSettings(max_new_tokens=40, stop=(stop,)))
    assert cut.reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    first = "".join(pieces).index(stop)
    ends = np.cumsum([len(p) for p in pieces])
    assert len(cut.tokens) == int(np.searchsorted(ends, first + len(stop))) + 1
    assert cut.stats.new_tokens == len(cut.tokens)


def test_stop_during_a_long_prefill_ends_it_between_chunks():
    oracle = OracleTarget(32, seed=0, max_batch=16)

    class StopAfter(threading.Event):
        """Stop pressed while the second chunk of the prompt is computed."""

        def __init__(self, calls: int) -> None:
            super().__init__()
            self.calls = calls

        def is_set(self) -> bool:
            self.calls -= 1
            return self.calls < 0 or super().is_set()

    prompt = list(range(32)) * 7  # 224 tokens: 14 chunks of 16
    events = list(generate(oracle, PLDDrafter(costs=COSTS), prompt, GenerationSettings(), cancel=StopAfter(2)))
    assert [type(e) for e in events] == [Finished] and events[0].reason == "cancelled"
    assert oracle.forwards == 2 and oracle.n_past == 32  # a prefix stays for the next prefill to reuse
    again = run(oracle, PLDDrafter(costs=COSTS), prompt, GenerationSettings(max_new_tokens=4))
    assert again.stats.reused_tokens == 32


def test_stop_during_the_draft_models_own_prefill_ends_the_answer():
    oracle = OracleTarget(32, seed=0)
    draft_oracle = OracleTarget(32, seed=1, max_batch=16)
    cancel = threading.Event()
    draft = DraftModelDrafter(draft_oracle, sampling=GREEDY, target_vocab=32, costs=COSTS, draft_costs=CHEAP_DRAFT,
                              stop=lambda: draft_oracle.forwards >= 1 or cancel.is_set())
    events = list(generate(oracle, draft, list(range(32)) * 4, GenerationSettings(), cancel=cancel))
    assert [type(e) for e in events] == [Finished] and events[0].reason == "cancelled"
    assert draft_oracle.forwards == 1


def test_a_conversation_that_outgrows_the_context_leaves_out_its_oldest_turns():
    """``Session.fitting_prompt``, shared by the terminal chat and the desktop worker."""
    from backends.factory import Session

    def chat_prompt(messages, chat_format=None):
        return [0] * sum(1 + len(m["content"].split()) for m in messages)

    fake = SimpleNamespace(model=SimpleNamespace(chat_prompt=chat_prompt), target=SimpleNamespace(n_ctx=100))
    turns = [{"role": "system", "content": "be brief"}]
    for i in range(6):
        turns += [{"role": "user", "content": "word " * 10}, {"role": "assistant", "content": "word " * 10}]
    turns.append({"role": "user", "content": "last"})
    fitted = Session.fitting_prompt(fake, turns, max_new_tokens=16)
    assert len(fitted.tokens) + 16 <= 100 and fitted.dropped == 5  # 137 tokens, 11 per turn
    assert fitted.messages[0]["role"] == "system" and fitted.messages[-1]["content"] == "last"
    assert len(turns) == 14  # the conversation itself is left as it was


# --- f. per-step costs ------------------------------------------------------------------------------


def test_logits_read_after_the_next_forward_raise_instead_of_lying():
    live = {"fresh": True}
    out = TargetOutput(logits=np.eye(4, dtype=np.float32), fresh=lambda: live["fresh"])
    kept = out.row(2)
    assert out.top(1) == 1 and list(out.argmax()) == [0, 1, 2, 3] and list(out.argmax([3, 0])) == [3, 0]
    live["fresh"] = False
    with pytest.raises(StaleLogitsError):
        out.row(0)
    with pytest.raises(StaleLogitsError):
        out.argmax()
    assert list(kept) == [0, 0, 1, 0]  # a row taken in time is a copy and stays valid


def test_greedy_acceptance_reads_only_the_rows_it_reaches():
    class Rows(np.ndarray):
        """A logits array that records which rows are read."""

    logits = np.zeros((9, 16), dtype=np.float32)
    for row, token in enumerate([3, 4, 9, 1, 1, 1, 1, 1, 1]):
        logits[row, token] = 1.0
    read = []
    view = logits.view(Rows)
    view.__class__.__getitem__ = lambda self, i: read.append(i) or np.ndarray.__getitem__(self, i)
    from backends.core.acceptance import accept_greedy

    verdict = accept_greedy(TargetOutput(view), Proposal.chain([3, 4, 5, 6, 7, 8, 9, 10]), settings=GREEDY, history=[0])
    assert verdict.tokens == (3, 4, 9)
    assert read == [0, 1, 2]  # three rows of nine


@pytest.mark.parametrize("seed", range(4))
def test_rest_builds_only_the_trie_nodes_that_can_rank(tmp_path, seed):
    oracle = OracleTarget(32, seed=seed)
    store = _oracle_store(tmp_path, oracle, seed, GREEDY)
    rng = np.random.default_rng(seed)
    for _ in range(20):
        context = rng.integers(0, 32, size=3).tolist()
        full = store.continuations(context, max_len=4, min_len=1, depth=8, samples=256)
        few = store.continuations(context, max_len=4, min_len=1, depth=8, samples=256, top=16)
        a, b = full.ranked(8), few.ranked(8, top=16)
        assert len(few.tokens) <= len(full.tokens) and len(b.tokens) == min(16, len(a.tokens))
        for name in ("tokens", "parents", "probs"):
            assert np.array_equal(getattr(a, name)[:16], getattr(b, name)), name
