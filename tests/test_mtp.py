"""``mtp``: a model's own next-n block, run by llama.cpp, drafts for the EAGLE-2 drafter.

No small model with MTP layers exists offline, so these tests write one (``tests.mtp_model``:
llama.cpp's ``hy_v3``, width 64, one next-n block) and run it through real llama.cpp: detection
from the GGUF header, the MTP context, the states it reads, and greedy output equal to plain
decoding both where the block guesses wrong (random weights) and where it guesses right.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends.core.errors import BackendError, SpecDeckError
from backends.core.types import NATIVE_MTP, GenerationSettings, SamplingSettings
from backends.factory import Session, SessionConfig
from backends.llamacpp.model import LlamaModel, mtp_in_header
from backends.llamacpp.target import LlamaTarget
from backends.models.gguf_info import read_gguf_info
from tests.mtp_model import write_mtp_gguf

GREEDY = GenerationSettings(max_new_tokens=32, sampling=SamplingSettings())
TEXTS = ["The weather is nice today and the children", "def add(a, b):\n    return", "One, two, three,"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm_q4_path):
    folder = tmp_path_factory.mktemp("mtp")
    return {name: write_mtp_gguf(folder / f"{name}.gguf", smollm_q4_path, **kw)
            for name, kw in (("random", {}), ("copy", {"copy": True}), ("plain", {"nextn": 0}))}


def test_the_header_and_the_loaded_model_say_whether_a_next_n_block_is_there(tiny):
    assert read_gguf_info(tiny["random"], use_cache=False).n_layer_nextn == 1
    assert read_gguf_info(tiny["plain"], use_cache=False).n_layer_nextn == 0
    assert mtp_in_header(tiny["random"]) and not mtp_in_header(tiny["plain"])  # what the recommender reads
    with LlamaModel(tiny["random"]) as with_block, LlamaModel(tiny["plain"]) as without:
        assert with_block.n_layer == 2 and with_block.n_layer_nextn == 1 and with_block.has_mtp
        assert not without.has_mtp
        assert NATIVE_MTP in LlamaTarget(with_block, n_ctx=64).offers
        plain = LlamaTarget(without, n_ctx=64)
        assert NATIVE_MTP not in plain.offers
        with pytest.raises(BackendError, match="no next-n"):
            plain.native_head()


def test_the_library_names_the_block(tiny):
    from desktop.library import LibraryEntry, entry_details

    details = {name: entry_details(LibraryEntry(str(tiny[name]), name, tiny[name]), None, 256).architecture
               for name in ("random", "plain")}
    assert details == {"random": "hy_v3 + MTP", "plain": "hy_v3"}


def test_the_states_the_target_hands_out_are_the_ones_the_block_reads(tiny):
    """llama.cpp's MTP graph reads ``h_nextn``; SpecDeck hands drafters ``llama_get_embeddings``."""
    from llama_cpp import llama_cpp_ext

    with LlamaModel(tiny["random"]) as model:
        target = LlamaTarget(model, n_ctx=64)
        tokens = model.tokenize(TEXTS[0])
        llama_cpp_ext.llama_set_embeddings_nextn(target.ctx, True, False)
        target.prefill(tokens, hidden=True, hidden_from=0)
        nextn = np.ctypeslib.as_array(llama_cpp_ext.llama_get_embeddings_nextn(target.ctx),
                                      shape=(len(tokens), model.n_embd))
        np.testing.assert_allclose(target.hidden_states(0, len(tokens)), nextn, atol=1e-2)  # kept as float16
        target.close()


def test_the_block_drafts_a_chain_the_same_as_a_fresh_cache_and_refuses_anything_else(tiny):
    with LlamaModel(tiny["random"]) as model:
        target = LlamaTarget(model, n_ctx=64)
        tokens = model.tokenize(TEXTS[1])
        target.prefill(tokens, hidden=True, hidden_from=0)
        states = target.hidden_states(0, len(tokens) - 1)  # row t = (h_t, x_{t+1})
        head = target.native_head()
        n = len(states)
        whole = head.forward(states, np.array(tokens[1:]), np.arange(n), head.new_cache(), np.tri(n, dtype=bool))
        whole_lp = head.log_probs(whole)
        cache = head.new_cache()
        first = head.forward(states[:3], np.array(tokens[1:4]), np.arange(3), cache, np.tri(3, dtype=bool))
        cache.commit()
        assert np.allclose(first, whole[:3], atol=1e-4)
        for t in range(3, n):  # one scratch row at a time, as a tree grows one node per depth
            out = head.forward(states[t : t + 1], np.array(tokens[t + 1 : t + 2]), np.array([t]), cache,
                               np.ones((1, t - 3 + 1), bool))
            np.testing.assert_allclose(out[0], whole[t], atol=1e-4)
            np.testing.assert_allclose(head.log_probs(out)[0], whole_lp[t], atol=1e-3)
        cache.drop_scratch()
        assert cache.length == 3
        with pytest.raises(BackendError, match="chains"):
            head.forward(states[3:5], np.array(tokens[4:6]), np.array([3, 3]), cache, np.eye(2, dtype=bool))
        with pytest.raises(BackendError, match="continue the cache"):  # a row before the chain's end
            head.forward(states[1:2], np.array(tokens[2:3]), np.array([1]), cache, np.ones((1, 1), bool))
        # after a gap (a drafter whose gate was shut keeps only its last rows) the chain starts over
        fresh = head.forward(states[5:6], np.array(tokens[6:7]), np.array([5]), head.new_cache(), np.ones((1, 1), bool))
        out = head.forward(states[5:6], np.array(tokens[6:7]), np.array([5]), cache, np.ones((1, 1), bool))
        assert (cache.first, cache.length) == (5 + head.offset, 1)
        np.testing.assert_allclose(out, fresh, atol=1e-5)
        with pytest.raises(BackendError, match="last forward"):
            head.log_probs(whole)
        target.close()


def _answers(session: Session, method: str, settings: dict) -> list:
    out = []
    for text in TEXTS:
        session.reset()
        prompt = session.model.tokenize(text)
        out.append(list(session.generate(method, prompt, GREEDY, method_settings=settings))[-1])
    return out


@pytest.mark.parametrize("weights", ["random", "copy"])
def test_mtp_output_is_plain_greedy_decoding(tiny, weights):
    """Every guess is verified (fixed tree), so each step's rollback or acceptance is exercised:
    random weights guess wrong, the copying model right."""
    with Session(SessionConfig(model=str(tiny[weights]), n_ctx=256)) as session:
        plain = _answers(session, "ar", {})
        for top_k in (1, 3):
            drafted = _answers(session, "mtp", {"adaptive": False, "top_k": top_k, "depth": 3, "max_nodes": 6, "min_chance": 0.0})
            assert [d.tokens for d in drafted] == [p.tokens for p in plain]
            accepted = sum(d.stats.accepted for d in drafted)
            if weights == "copy":
                assert all(d.stats.tau > 2.5 for d in drafted), [d.stats.tau for d in drafted]
            else:
                assert accepted < sum(d.stats.drafted for d in drafted) / 4


def test_a_model_without_a_next_n_block_is_refused_with_the_reason(tiny):
    with Session(SessionConfig(model=str(tiny["plain"]), n_ctx=128)) as session:
        with pytest.raises(SpecDeckError, match="next-n"):
            list(session.generate("mtp", session.model.tokenize(TEXTS[2]), GREEDY))
