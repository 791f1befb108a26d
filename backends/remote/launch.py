"""The command that starts a serving engine with one speculative method, in the flags that
engine's version understands.

Why. A user picks "EAGLE-3" in SpecDeck's chooser; what vLLM or llama-server must be told for
that has changed shape from version to version:

- **vLLM 0.7 to 0.8.2** took one flag per setting: ``--speculative-model`` (a draft model, a head,
  or ``[ngram]``), ``--num-speculative-tokens``, ``--ngram-prompt-lookup-max/min``,
  ``--speculative-draft-tensor-parallel-size``. DeepSeek's MTP needed only
  ``--num-speculative-tokens``. EAGLE-3 and suffix decoding did not exist.
- **vLLM 0.8.3 and later** removed those flags for one JSON object, ``--speculative-config``
  ``{"method": ..., "model": ..., "num_speculative_tokens": ..., "prompt_lookup_max": ...}``.
  Which one a given install takes is read from ``vllm serve --help`` when it can be run, else
  from its version.
- **llama-server** renamed ``--model-draft``/``--draft-max``/``--draft-min`` to
  ``--spec-draft-model``/``--spec-draft-n-max``/``--spec-draft-n-min`` and added ``--spec-type``
  (``draft-simple``, ``draft-eagle3``, ``draft-mtp``, ``ngram-simple`` ...); the spelling is read
  from its ``--help``.

Methods are SpecDeck's names (``pld``, ``draft``, ``eagle2``, ``eagle3``, ``medusa``, ``mtp``,
``suffix``; ``ar`` is plain decoding); a method an engine generation lacks raises ``LaunchError``
saying which version has it. API keys never go on a command line (``ps`` shows it to every user):
vLLM reads ``VLLM_API_KEY`` and llama-server ``LLAMA_API_KEY`` from the environment.

Example: ``vllm_plan(VllmLaunch("meta-llama/Llama-3.1-8B-Instruct", "eagle3",
draft="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", num_tokens=6), generation="config")`` gives
``vllm serve meta-llama/Llama-3.1-8B-Instruct --host 127.0.0.1 --port 8000
--speculative-config '{"method": "eagle3", "model": "yuhuili/...", "num_speculative_tokens": 6}'``.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field

from backends.core.errors import SpecDeckError

LEGACY, CONFIG = "legacy", "config"  # the two generations of vLLM's flags
VLLM_METHODS = {  # SpecDeck's name -> vLLM's method
    "pld": "ngram", "draft": "draft_model", "eagle2": "eagle", "eagle3": "eagle3",
    "medusa": "medusa", "mtp": "mtp", "suffix": "suffix",
}
_LEGACY_LACKS = {"eagle3": "0.8.5", "suffix": "0.11"}
_NEEDS_MODEL = {"draft", "eagle2", "eagle3", "medusa"}
_CONFIG_FROM = (0, 8, 3)  # #15466 removed the one-flag-per-setting form


class LaunchError(SpecDeckError):
    """The engine (or this version of it) cannot run the method asked for, or a setting is missing."""


@dataclass(frozen=True)
class Parallel:
    """How the model is split: ``tensor`` GPUs per pipeline stage, ``pipeline`` stages, over
    ``nodes`` machines (more than one: a Ray cluster whose head is ``head_address``)."""

    tensor: int = 1
    pipeline: int = 1
    nodes: int = 1
    head_address: str = ""

    def __post_init__(self) -> None:
        if min(self.tensor, self.pipeline, self.nodes) < 1:
            raise LaunchError("tensor, pipeline and node counts must be at least 1")
        if self.nodes > 1 and not self.head_address:
            raise LaunchError("a multi-node launch needs the head node's address (host or IP)")


@dataclass(frozen=True)
class VllmLaunch:
    """One vLLM server: the target, the method (SpecDeck's name) and its settings."""

    model: str
    method: str = "ar"
    draft: str | None = None  # draft model or head (path or Hub id)
    num_tokens: int = 5
    ngram_max: int = 4
    ngram_min: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    parallel: Parallel = field(default_factory=Parallel)
    extra: tuple[str, ...] = ()  # passed through as they are (--max-model-len 8192 ...)


@dataclass(frozen=True)
class LaunchPlan:
    """What to run, in order, and where: ``steps`` are (where, argv) pairs, e.g. ("every other
    node", ["ray", "start", ...]); ``env`` names the environment variables the server reads."""

    steps: tuple[tuple[str, tuple[str, ...]], ...]
    env: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def server(self) -> tuple[str, ...]:
        """The argv that starts the server itself (the last step)."""
        return self.steps[-1][1]

    def shell(self) -> str:
        """The plan as shell lines a person can paste, each with where it runs."""
        lines = [f"# {note}" for note in self.notes]
        lines += [f"export {name}=...  # your API key, not on the command line" for name in self.env]
        lines += [f"# on {where}:\n{shlex.join(argv)}" for where, argv in self.steps]
        return "\n".join(lines)


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def vllm_generation(*, version: str | None = None, help_text: str | None = None) -> str:
    """LEGACY or CONFIG for an installed vLLM: from ``vllm serve --help`` when known (the flag
    itself is the proof), else from its version."""
    if help_text is not None:
        return CONFIG if "--speculative-config" in help_text else LEGACY
    if version:
        return CONFIG if _version_tuple(version) >= _CONFIG_FROM else LEGACY
    return CONFIG


def _speculative_config(launch: VllmLaunch, method: str) -> dict[str, object]:
    config: dict[str, object] = {"method": method, "num_speculative_tokens": launch.num_tokens}
    if launch.draft is not None:
        config["model"] = launch.draft
    if method == "ngram":
        config.update(prompt_lookup_max=launch.ngram_max, prompt_lookup_min=launch.ngram_min)
    if launch.draft is not None and launch.parallel.tensor > 1:
        config["draft_tensor_parallel_size"] = 1  # a small draft model does not split well
    return config


def _legacy_flags(launch: VllmLaunch, method: str) -> list[str]:
    if launch.method in _LEGACY_LACKS:
        raise LaunchError(f"vLLM runs {launch.method} from version {_LEGACY_LACKS[launch.method]} on "
                          "(--speculative-config); this vLLM takes only the older flags")
    flags = ["--num-speculative-tokens", str(launch.num_tokens)]
    if method == "ngram":
        flags = ["--speculative-model", "[ngram]", *flags, "--ngram-prompt-lookup-max", str(launch.ngram_max),
                 "--ngram-prompt-lookup-min", str(launch.ngram_min)]
    elif launch.draft is not None:
        flags = ["--speculative-model", launch.draft, *flags]
        if launch.parallel.tensor > 1:
            flags += ["--speculative-draft-tensor-parallel-size", "1"]
    return flags


def _method_flags(launch: VllmLaunch, generation: str) -> list[str]:
    if launch.method == "ar":
        return []
    method = VLLM_METHODS.get(launch.method)
    if method is None:
        raise LaunchError(f"vLLM has no counterpart of {launch.method!r}; it runs {', '.join(VLLM_METHODS)}")
    if launch.method in _NEEDS_MODEL and not launch.draft:
        raise LaunchError(f"{launch.method} on vLLM needs the draft model or head to load (a path or Hub id)")
    if generation == LEGACY:
        return _legacy_flags(launch, method)
    return ["--speculative-config", json.dumps(_speculative_config(launch, method))]


def vllm_plan(launch: VllmLaunch, *, generation: str = CONFIG) -> LaunchPlan:
    """The commands that start ``launch`` on a vLLM of ``generation`` (LEGACY or CONFIG)."""
    par = launch.parallel
    argv = ["vllm", "serve", launch.model, "--host", launch.host, "--port", str(launch.port)]
    if par.tensor > 1:
        argv += ["--tensor-parallel-size", str(par.tensor)]
    if par.pipeline > 1:
        argv += ["--pipeline-parallel-size", str(par.pipeline)]
    argv += _method_flags(launch, generation)
    steps: list[tuple[str, tuple[str, ...]]] = []
    notes = [f"{par.tensor * par.pipeline} GPU(s) in all"] if par.tensor * par.pipeline > 1 else []
    if par.nodes > 1:
        argv += ["--distributed-executor-backend", "ray"]
        steps.append(("the head node", ("ray", "start", "--head", "--port", "6379")))
        steps.append((f"each of the other {par.nodes - 1} node(s)", ("ray", "start", f"--address={par.head_address}:6379")))
        notes.append("every node needs the same vLLM, model files and network reach of the head")
    steps.append(("the head node" if par.nodes > 1 else "the server", tuple(argv + list(launch.extra))))
    return LaunchPlan(tuple(steps), env=("VLLM_API_KEY",), notes=tuple(notes))


# -- llama-server ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaServerFlags:
    """How a llama-server build spells its speculative settings (None: it has no such flag)."""

    draft_model: str = "--model-draft"
    draft_max: str = "--draft-max"
    draft_min: str | None = "--draft-min"
    spec_type: str | None = None
    spec_types: tuple[str, ...] = ()  # the values its --spec-type takes


_SPELLINGS = {  # setting -> its flag, newest spelling first
    "draft_model": ("--spec-draft-model", "--model-draft"),
    "draft_max": ("--spec-draft-n-max", "--draft-max", "--draft"),
    "draft_min": ("--spec-draft-n-min", "--draft-min"),
}
LLAMA_NEWER = LlamaServerFlags(**{key: names[0] for key, names in _SPELLINGS.items()},
                               spec_type="--spec-type")  # a current build; every --spec-type value taken


def llama_server_flags(help_text: str) -> LlamaServerFlags:
    """The spelling a llama-server's ``--help`` shows (newest spelling first where it has both)."""
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", help_text))
    found = {key: next((name for name in names if name in flags), None) for key, names in _SPELLINGS.items()}
    types: tuple[str, ...] = ()
    if "--spec-type" in flags:
        line = next((ln for ln in help_text.splitlines() if "--spec-type" in ln), "")
        types = tuple(re.findall(r"\b(?:draft|ngram)-[a-z0-9-]+|\bnone\b", line.partition("--spec-type")[2]))
    if found["draft_model"] is None or found["draft_max"] is None:
        raise LaunchError("this llama-server shows no draft-model flags in --help; it is too old for speculative decoding")
    return LlamaServerFlags(draft_model=found["draft_model"], draft_max=found["draft_max"], draft_min=found["draft_min"],
                            spec_type="--spec-type" if "--spec-type" in flags else None, spec_types=types)


LLAMA_TYPES = {"draft": "draft-simple", "eagle3": "draft-eagle3", "mtp": "draft-mtp", "pld": "ngram-simple"}


def llama_server_plan(model: str, *, flags: LlamaServerFlags, method: str = "ar", draft: str | None = None,
                      num_tokens: int = 8, host: str = "127.0.0.1", port: int = 8080, gpu_layers: int | None = None,
                      binary: str = "llama-server", extra: tuple[str, ...] = ()) -> LaunchPlan:
    """The command that starts llama-server on ``model`` with ``method``, in ``flags``' spelling."""
    argv = [binary, "-m", model, "--host", host, "--port", str(port), "--metrics"]
    if gpu_layers is not None:
        argv += ["-ngl", str(gpu_layers)]
    if method != "ar":
        kind = LLAMA_TYPES.get(method)
        if kind is None:
            raise LaunchError(f"llama-server has no counterpart of {method!r}; it runs {', '.join(LLAMA_TYPES)}")
        if kind != "draft-simple" and (flags.spec_type is None or (flags.spec_types and kind not in flags.spec_types)):
            raise LaunchError(f"this llama-server cannot run {method} (its --spec-type lacks {kind}); a newer build can")
        if method in ("draft", "eagle3") and not draft:
            raise LaunchError(f"{method} on llama-server needs the draft GGUF to load")
        if draft:
            argv += [flags.draft_model, draft]
        if flags.spec_type is not None:
            argv += [flags.spec_type, kind]
        argv += [flags.draft_max, str(num_tokens)]
    return LaunchPlan((("the server", tuple(argv + list(extra))),), env=("LLAMA_API_KEY",))
