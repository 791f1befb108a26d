"""Chat templates: turning a conversation into the prompt text a model was trained on.

The template is the Jinja2 string stored in the GGUF (``tokenizer.chat_template``), rendered in a
sandbox the way Hugging Face renders it (``messages``, ``add_generation_prompt``, ``bos_token``,
``eos_token``). A model without one (a base model such as Gemma-3-270M) gets a plain transcript
("User: ...\\nAssistant:") and the stop string ``"\\nUser:"``, so it answers once instead of
writing both sides of the dialogue.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence, TypedDict

from backends.core.errors import SpecDeckError


class Message(TypedDict):
    role: str  # system, user or assistant
    content: str


@dataclass(frozen=True)
class ChatFormat:
    """How one model wants its conversations written."""

    template: str | None
    bos_token: str = ""
    eos_token: str = ""

    @property
    def stop(self) -> tuple[str, ...]:
        """Stop strings this format needs beyond the model's end-of-generation tokens."""
        return () if self.template else ("\nUser:",)

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        if not self.template:
            return _plain_transcript(messages, add_generation_prompt)
        try:
            return _compiled(self.template).render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except Exception as exc:  # jinja2 raises many types; the user needs to know the template broke
            raise SpecDeckError(f"the chat template could not be rendered: {exc}") from exc


def _plain_transcript(messages: Sequence[Message], add_generation_prompt: bool) -> str:
    names = {"system": "", "user": "User: ", "assistant": "Assistant: "}
    lines = [f"{names.get(m['role'], m['role'].title() + ': ')}{m['content']}" for m in messages]
    text = "\n".join(lines)
    return text + ("\nAssistant:" if add_generation_prompt else "")


@lru_cache(maxsize=8)
def _compiled(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise SpecDeckError(f"the model's chat template is not valid Jinja2: {exc}") from exc
