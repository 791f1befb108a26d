"""SpecDeck's plain decoding (``ar``) is llama.cpp's own greedy decoding.

Ten Spec-Bench prompts (two from each of five categories, every turn) through ``ar`` and through
llama-cpp-python's high-level ``Llama.generate`` on the same F16 file: the token sequences must
be identical, or part only where the target's top-2 logits are within the batch noise measured
for this model here (``Session.batch_noise``, the source the bench and the window use too).
"""

from __future__ import annotations

from backends.bench import EngineRunner, PeerRunner, default_prompts, divergence, load_prompts, play
from backends.core.types import GenerationSettings, SamplingSettings
from backends.factory import Session, SessionConfig

CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning")


def test_ar_is_llama_cpp_pythons_greedy_decoding(smollm_f16_path):
    prompts = load_prompts(default_prompts(), per_category=2, categories=CATEGORIES)
    assert len(prompts) == 10
    gen = GenerationSettings(max_new_tokens=64, sampling=SamplingSettings(temperature=0.0))
    with Session(SessionConfig(model=str(smollm_f16_path), n_ctx=2048)) as session:
        ours, peer = EngineRunner(session, "ar", {}), PeerRunner(session, "peer-llamacpp")
        try:
            results = [(p, play(ours, session, p, gen), play(peer, session, p, gen)) for p in prompts]
        finally:
            peer.close()
        margin = session.batch_noise().threshold
        apart = []
        for prompt, mine, theirs in results:
            assert all(r.tokens for r in mine) and len(mine) == len(prompt.turns)
            div = divergence(session, theirs, mine, gen.sampling)
            if div is not None:
                apart.append((prompt.question_id, div))
    assert all(d["margin"] <= margin for _, d in apart), f"parted beyond a near-tie ({margin}): {apart}"
    assert len(apart) <= 2, f"ar and Llama.generate parted on {len(apart)} of 10 prompts: {apart}"
