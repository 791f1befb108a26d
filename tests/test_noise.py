"""The near-tie scale is measured, not assumed: batch noise per model on this machine."""

from __future__ import annotations

import numpy as np

from backends.core.noise import FLOOR, SAFETY, BatchNoise, measure_batch_noise
from backends.factory import Session, SessionConfig
from tests.oracle import OracleTarget


def test_an_exact_target_has_no_batch_noise():
    """The oracle's logits do not depend on batching: the measured shift is exactly zero, over the
    chain and the tree (2 prompts x 7 rows x 2 shapes)."""
    target = OracleTarget()
    noise = measure_batch_noise(target, [[1, 2, 3, 4], [5, 6, 7]], depth=6)
    assert noise == BatchNoise(gap_shift=0.0, logit_shift=0.0, rows=28)
    assert noise.threshold == FLOOR and target.n_past == 0


class TreeRoundingTarget(OracleTarget):
    """Rounds tree verifies differently from chains, as llama.cpp's quantized kernels can: every
    row of a forward whose proposal branches gets ``shift`` added to its top token's logit."""

    def __init__(self, shift: float) -> None:
        super().__init__()
        self.shift = shift

    def verify(self, root, proposal):
        out = super().verify(root, proposal)
        if proposal.size and not proposal.is_chain:
            top = out.logits.argmax(axis=1)
            out.logits[np.arange(len(top)), top] += self.shift
        return out


def test_a_shift_that_only_trees_show_is_measured():
    """A chain of the same tokens agrees exactly; the tree's main path does not, and its shift is
    the noise. A target without trees is measured on chains alone."""
    noise = measure_batch_noise(TreeRoundingTarget(0.25), [[1, 2, 3, 4]], depth=6)
    assert abs(noise.gap_shift - 0.25) < 1e-5 and noise.rows == 14
    chains_only = TreeRoundingTarget(0.25)
    chains_only.offers = frozenset()
    assert measure_batch_noise(chains_only, [[1, 2, 3, 4]], depth=6) == BatchNoise(0.0, 0.0, rows=7)


def test_the_description_says_near_tie_or_real_difference():
    noise = BatchNoise(gap_shift=0.1, logit_shift=0.3, rows=10)
    assert noise.threshold == SAFETY * 0.1
    assert noise.describe(0.14).startswith("a numerical near-tie (margin 0.140, this model's batch noise 0.100)")
    assert noise.describe(0.5).startswith("a real difference")


def test_a_real_models_batch_noise_is_measured_once_and_kept(smollm_q4_path, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECK_CACHE_DIR", str(tmp_path))
    with Session(SessionConfig(model=str(smollm_q4_path), n_ctx=1024)) as session:
        noise = session.batch_noise()
        assert noise.rows == 3 * 17 * 2 and np.isfinite(noise.gap_shift) and noise.logit_shift >= noise.gap_shift / 2
        assert session.target.n_past == 0
    assert len(list((tmp_path / "noise").glob("*.json"))) == 1
    with Session(SessionConfig(model=str(smollm_q4_path), n_ctx=1024)) as again:
        assert again.batch_noise() == noise  # read back, not measured again
