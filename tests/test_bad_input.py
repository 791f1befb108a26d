"""Bad input gets a clear error, never a crash or a hang: files, drafts, prompts, settings."""

from __future__ import annotations

import subprocess
import sys

import pytest

from backends.core.errors import IncompatibleDraftError, ModelFileError, PromptTooLongError, SpecDeckError
from backends.core.types import GenerationSettings
from backends.factory import Session, SessionConfig
from backends.llamacpp.model import LlamaModel
from backends.models.gguf_info import read_gguf_info


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        LlamaModel(tmp_path / "nope.gguf")
    with pytest.raises(ModelFileError, match="not found"):
        read_gguf_info(tmp_path / "nope.gguf")


def test_not_a_gguf_file(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("this is a text file, not weights\n" * 100)
    with pytest.raises(ModelFileError, match="not a GGUF model"):
        LlamaModel(fake)
    with pytest.raises(ModelFileError, match="not a GGUF model"):
        read_gguf_info(fake)


def test_folder_instead_of_file(tmp_path):
    with pytest.raises(ModelFileError, match="folder"):
        LlamaModel(tmp_path)


def test_truncated_gguf(tmp_path, smollm_q4_path):
    cut = tmp_path / "truncated.gguf"
    with open(smollm_q4_path, "rb") as src:
        cut.write_bytes(src.read(20 * 2**20))  # header and tensor table intact, weights cut short
    with pytest.raises(ModelFileError, match="truncated"):
        read_gguf_info(cut, use_cache=False)
    with pytest.raises(ModelFileError, match="could not load"):
        LlamaModel(cut)
    head = tmp_path / "head.gguf"
    with open(smollm_q4_path, "rb") as src:
        head.write_bytes(src.read(4096))  # cut inside the metadata
    with pytest.raises(ModelFileError):
        read_gguf_info(head, use_cache=False)
    with pytest.raises(ModelFileError):
        LlamaModel(head)


def test_incompatible_draft_is_refused_with_reasons(smollm_q4_path, gemma_path):
    with pytest.raises(IncompatibleDraftError) as err:
        Session(SessionConfig(model=str(smollm_q4_path), draft_model=str(gemma_path), n_ctx=256))
    message = str(err.value)
    assert "tokenizer type differs" in message and "vocabulary sizes differ" in message


def test_prompt_longer_than_context(smollm_q4_path):
    with Session(SessionConfig(model=str(smollm_q4_path), n_ctx=256)) as s:
        prompt = s.model.tokenize("word " * 400)
        with pytest.raises(PromptTooLongError, match="context holds 256"):
            list(s.generate("ar", prompt, GenerationSettings(max_new_tokens=8)))
        # the session still works afterwards
        ok = list(s.generate("ar", s.model.tokenize("Hello"), GenerationSettings(max_new_tokens=4)))
        assert ok[-1].stats.new_tokens == 4


def test_zero_new_tokens_and_unknown_method(smollm_q4_path):
    with pytest.raises(ValueError, match="at least 1"):
        GenerationSettings(max_new_tokens=0)
    with Session(SessionConfig(model=str(smollm_q4_path), n_ctx=256)) as s:
        with pytest.raises(SpecDeckError, match="unknown method"):
            s.generate("nonsense", [1, 2], GenerationSettings())
        with pytest.raises(SpecDeckError, match="needs a draft model|needs draft_model"):
            s.generate("draft", [1, 2], GenerationSettings())
        with pytest.raises(SpecDeckError, match="has no setting"):
            s.generate("pld", [1, 2], GenerationSettings(), method_settings={"bogus": 1})
        with pytest.raises(ValueError, match="max_draft"):
            s.generate("pld", [1, 2], GenerationSettings(), method_settings={"max_draft": 0})


def run_cli(*args: str, stdin: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backends.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args,needle", [
    (["chat", "--model", "/no/such/model.gguf"], "not found"),
    (["chat", "--model", "no-such-id"], "unknown model id"),
    (["chat", "--max-new-tokens", "0"], "at least 1"),
    (["chat", "--method", "draft"], "draft model"),
    (["models", "path", "no-such-id"], "unknown model id"),
])
def test_cli_reports_errors_without_traceback(args, needle):
    result = run_cli(*args)
    assert result.returncode == 2
    assert needle in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_chat_with_incompatible_draft(gemma_path):
    result = run_cli("chat", "--method", "draft", "--draft-model", str(gemma_path))
    assert result.returncode == 2 and "cannot draft" in result.stderr and "Traceback" not in result.stderr
