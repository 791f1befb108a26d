"""Training heads with torch on recorded samples (``backends.heads.record``): ``HeadTrainer``
(checkpoints, resuming, seeded batches, the best held-out head kept) runs one ``Recipe`` per kind
of head; this module holds Medusa's, ``eagle_training`` EAGLE's.

Only these modules need torch (the ``train`` extra); running a trained head needs numpy alone.

Data. Every answer position ``t`` (from the prompt's last token on) gives one example: its
hidden state, and the tokens ``t + 2 .. t + 1 + K`` the heads must predict. One answer in twenty
(chosen by index) is held out to measure top-1 agreement per head, which is what acceptance
follows. The draft vocabulary is the ``V'`` tokens the answers use most, plus the end tokens.

Loss. Cross-entropy per head over the draft vocabulary, head ``k`` weighted ``0.8 ** (k - 1)``
as in Medusa-1 (far heads are wrong more often and matter less: a guess is only worth something
after all guesses before it were right); targets outside the draft vocabulary are skipped.

Device. A CUDA GPU that torch sees trains the head (``training_device``): the module, its
optimizer and each step's batch live there, the recorded examples stay in host memory (a batch
crosses once per step) and the input noise is drawn on the host, so a seed gives the same noise
on any device. Checkpoints and the exported head are host tensors: a run begun on the GPU goes on
on the CPU and the other way round.

Precision. Where this device multiplies bfloat16 natively (AVX512-BF16, AMX; GPUs from Ampere
on), each step's forward runs under bfloat16 autocast, its weights, AdamW moments and held-out
evaluation staying float32: on 2 AMD EPYC Zen 4 cores an EAGLE step took 0.61 s against 1.13-1.26
s, an unrolled MTP one 1.6 s against 3.1 s (2026-12-07). ``training_precision`` times one product
both ways and picks.

Reproducible and resumable. The example order of each epoch is a permutation drawn from
``seed`` and the epoch number, and a checkpoint (weights, AdamW moments, step, every
``CHECKPOINT_S`` seconds and at the end, safetensors like everything else) lets a killed run go on
from where it was: the same seed and step count give the same head, interrupted or not.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from backends.core.errors import SpecDeckError
from backends.heads.files import HeadFile, ModelFingerprint
from backends.heads.medusa import KIND
from backends.heads.record import Sample
from backends.models.paths import write_atomic

CHECKPOINT_S = 30.0
PRECISIONS = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
BF16_SHARE = 0.75  # bfloat16 autocast trains where its product takes at most this share of float32's
HOLDOUT_EVERY = 20  # one conversation in 20 is held out (the last one, if there are fewer)


def torch_or_error():
    from backends.addons import require

    return require("torch", "training a head")


def training_device(requested: str = "auto") -> str:
    """``cuda`` or ``cpu``: what was asked, or for ``auto`` the GPU where torch sees one. Asking for
    a GPU torch cannot use is an error that says why (a CPU-only torch, or no usable device)."""
    if requested not in DEVICES:
        raise SpecDeckError(f"device {requested!r}: choose one of {', '.join(DEVICES)}")
    torch = torch_or_error()
    if requested == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if requested == "auto":
        return "cpu"
    if torch.version.cuda is None:
        raise SpecDeckError(f"--device cuda: this torch ({torch.__version__}) is the CPU-only build; install a CUDA "
                            "build of torch (https://pytorch.org/get-started/locally/) or train with --device cpu")
    raise SpecDeckError(f"--device cuda: torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable NVIDIA "
                        "GPU (no device, or its driver is older than this CUDA); train with --device cpu")


def device_name(device: str) -> str:
    """What people call ``device``: "the CPU", or the GPU's own name (its driver's)."""
    if device == "cpu":
        return "the CPU"
    return torch_or_error().cuda.get_device_name(device)


def training_precision(requested: str = "auto", device: str = "cpu") -> str:
    """``float32`` or ``bfloat16`` (autocast): what was asked, or for ``auto`` the faster on ``device``."""
    if requested not in PRECISIONS:
        raise SpecDeckError(f"precision {requested!r}: choose one of {', '.join(PRECISIONS)}")
    return _faster_precision(device) if requested == "auto" else requested


@functools.cache
def _faster_precision(device: str = "cpu") -> str:
    """Timed once per process and device (about 0.3 s on a CPU): a training-sized product, [2048,
    576] rows through a 576 -> 1536 layer, in float32 and under bfloat16 autocast. Natively the
    latter takes under half the time (AMD EPYC Zen 4: 17 ms against 38 ms); emulated, more than
    float32's. The margin keeps a machine from flipping between runs, which would change the head a
    seed gives."""
    torch = torch_or_error()
    x, w = torch.full((2048, 576), 0.01, device=device), torch.full((1536, 576), 0.01, device=device)
    settle = torch.cuda.synchronize if device == "cuda" else (lambda: None)  # a GPU returns before it is done

    def seconds(bf16: bool) -> float:
        best = float("inf")
        for round_ in range(4):  # the first is untimed: threads start, clocks rise, kernels load
            start = time.perf_counter()
            with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
                torch.nn.functional.linear(x, w)
            settle()
            if round_:
                best = min(best, time.perf_counter() - start)
        return best

    choice = "bfloat16" if seconds(True) <= BF16_SHARE * seconds(False) else "float32"
    del x, w
    if device == "cuda":
        torch.cuda.empty_cache()  # timed before the model loads: its offload gets the memory back
    return choice


@dataclass(frozen=True)
class MedusaTrainConfig:
    n_heads: int = 4
    draft_vocab: int = 4096
    lr: float = 1e-3
    batch: int = 256
    weight_decay: float = 0.0
    decay: float = 0.8  # loss weight of head k: decay ** (k - 1)
    seed: int = 0
    precision: str = "auto"  # the training products' type (``training_precision``)
    train_lm: bool = False  # also train the output layer (over-fits the few answers a PC records in minutes)
    eval_every: int = 250  # steps between held-out evaluations; the best evaluated head is the one kept
    max_epochs: float = 8.0  # at most this many passes over the examples


@dataclass
class Examples:
    states: np.ndarray  # [N, d] float16
    targets: np.ndarray  # [N, K] int64 draft-vocabulary ids, -1 where none
    held_out: np.ndarray  # [N] bool


def draft_vocabulary(samples: Sequence[Sample], size: int, always: Sequence[int], n_vocab: int) -> np.ndarray:
    """The ``size`` tokens most used in the answers (ties by id), ``always`` included; sorted ids."""
    counts = np.zeros(n_vocab, dtype=np.int64)
    for s in samples:
        np.add.at(counts, s.tokens[s.n_prompt:], 1)
    forced = [t for t in always if 0 <= t < n_vocab]
    counts[forced] = counts.max() + 1
    order = np.lexsort((np.arange(n_vocab), -counts))
    chosen = order[: min(size, n_vocab)]
    return np.sort(chosen).astype(np.int64)


def held_out(numbers: Sequence[int], group: Callable[[int], int]) -> set[int]:
    """The sample numbers held out: whole conversations (``group``), one in ``HOLDOUT_EVERY``, or
    the last conversation when there are fewer, so agreement is never measured on training data."""
    groups = sorted({group(n) for n in numbers})
    chosen = {g for g in groups if g % HOLDOUT_EVERY == HOLDOUT_EVERY - 1} or set(groups[-1:])
    if len(chosen) == len(groups):
        return set()
    return {n for n in numbers if group(n) in chosen}


def medusa_examples(samples: Sequence[tuple[int, Sample]], vocab: np.ndarray, n_heads: int, n_vocab: int,
                    group: Callable[[int], int] = lambda n: n) -> Examples:
    """One example per answer position: its state and the K tokens after the next one; ``group``
    maps a sample's number to its conversation (held out together)."""
    test = held_out([n for n, _ in samples], group)
    index = np.full(n_vocab, -1, dtype=np.int64)
    index[vocab] = np.arange(len(vocab))
    states, targets, held = [], [], []
    for number, s in samples:
        start, n = s.n_prompt - 1, len(s.tokens) - 1  # positions whose state is kept, answer part
        if n <= start:
            continue
        positions = np.arange(start, n)
        tgt = np.full((len(positions), n_heads), -1, dtype=np.int64)
        for k in range(1, n_heads + 1):
            ahead = positions + 1 + k
            ok = ahead < len(s.tokens)
            tgt[ok, k - 1] = index[s.tokens[ahead[ok]]]
        states.append(s.states[positions])
        targets.append(tgt)
        held.append(np.full(len(positions), number in test))
    if not states:
        raise SpecDeckError("the recorded answers are empty: nothing to train on")
    return Examples(np.concatenate(states), np.concatenate(targets), np.concatenate(held))


def _module(torch, k: int, d: int, lm_init: np.ndarray, train_lm: bool):
    nn = torch.nn

    class Medusa(nn.Module):
        """Residual blocks start at zero, so every head starts as the target's next-token guess.
        The output layer is the target's own rows over the draft vocabulary, frozen by default."""

        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(k, d, d))
            self.b = nn.Parameter(torch.zeros(k, d))
            lm = torch.from_numpy(lm_init.astype(np.float32))
            if train_lm:
                self.lm = nn.Parameter(lm)
            else:
                self.register_buffer("lm", lm)

        def forward(self, x):  # [N, d] -> [N, K, V']
            z = torch.einsum("kij,nj->nki", self.w, x) + self.b
            h = x[:, None, :] + torch.nn.functional.silu(z)
            return h @ self.lm.T

    return Medusa()


@dataclass
class Progress:
    step: int
    steps: int
    loss: float
    agreement: list[float] = field(default_factory=list)  # held-out top-1 per draft position
    seconds: float = 0.0
    eta: float = 0.0


class Recipe(Protocol):
    """What one kind of head brings to ``HeadTrainer``: its torch module and data."""

    model: Any  # a torch.nn.Module
    n_train: int  # training items (examples, or sequences); a batch is ``batch`` of them
    identity: int  # changes when the data does (a checkpoint of other data is not resumed)

    def place(self, device: str) -> None:
        """Moves the module, and every tensor the recipe keeps, to ``device`` (before training)."""

    def loss(self, items: np.ndarray, step: int) -> Any:
        """The scalar loss of training items ``items`` at ``step`` (noise may depend on the step)."""

    def agreement(self) -> list[float]:
        """Held-out top-1 agreement with the target per draft position (the next conditional on
        the ones before being right, where the head drafts a chain of its own guesses)."""

    def export(self, state: dict) -> tuple[dict, dict[str, np.ndarray]]:
        """The head file's config and tensors for module state ``state``."""


class OnDevice:
    """What a recipe needs to train on any device: its module and the tensors it keeps (``kept``,
    attribute names) move there once (``place``); each step's host arrays cross with ``tensor``."""

    torch: Any
    model: Any
    device = "cpu"
    kept: tuple[str, ...] = ()

    def place(self, device: str) -> None:
        self.device = device
        self.model.to(device)
        for name in self.kept:
            setattr(self, name, getattr(self, name).to(device))

    def tensor(self, array: np.ndarray):
        """A host array as a tensor on the recipe's device."""
        return self.torch.from_numpy(array).to(self.device)


class HeadTrainer:
    """Trains, checkpoints, resumes and exports one head of any kind (a ``Recipe``) on the device
    ``device`` names (``training_device``: ``auto`` takes a CUDA GPU where torch sees one)."""

    def __init__(self, recipe: Recipe, kind: str, target: ModelFingerprint, config: Any, checkpoint: Path,
                 device: str = "auto") -> None:
        self.torch = torch_or_error()
        self.recipe, self.kind, self.target, self.config = recipe, kind, target, config
        self.device = training_device(device)
        recipe.place(self.device)  # before the optimizer, which keeps its moments beside the weights
        self.model = recipe.model
        self.checkpoint = checkpoint
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = self.torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        self.step = 0
        self.steps = 0
        self.best: tuple[float, int, dict] | None = None  # (score, step, weights) of the best evaluation
        self.precision = ""  # what the steps run in: a resumed run's own, else ``training_precision``
        self._resume()
        self.saved = self.step  # the step the checkpoint on disk holds (what a rerun goes on from)
        self.precision = self.precision or training_precision(config.precision, self.device)

    # -- checkpoints ---------------------------------------------------------------------------
    def _resume(self) -> None:
        meta = self.checkpoint.with_suffix(".json")
        if not meta.exists():
            return
        from safetensors.torch import load_file

        info = json.loads(meta.read_text())
        if info.get("config") != self.config.__dict__ or info.get("examples") != self.recipe.identity:
            return  # another run's checkpoint: start over
        if int(info["step"]) >= int(info["steps"]):
            return  # a finished run: a new command trains anew (to the same head, for the same steps)
        precision = info.get("precision", "float32")  # the run goes on in its own (an asked one is in its config)
        tensors = load_file(str(self.checkpoint))
        self.model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
        state = self.opt.state_dict()
        for i, p in enumerate(self.opt.param_groups[0]["params"]):
            state["state"][i] = {"step": tensors[f"opt.{i}.step"], "exp_avg": tensors[f"opt.{i}.exp_avg"],
                                 "exp_avg_sq": tensors[f"opt.{i}.exp_avg_sq"]}
        self.opt.load_state_dict(state)
        self.step, self.steps, self.precision = int(info["step"]), int(info["steps"]), precision
        best = {k[5:]: v for k, v in tensors.items() if k.startswith("best.")}
        if best:
            self.best = (float(info["best_score"]), int(info["best_step"]), best)

    def save_checkpoint(self) -> None:
        from safetensors.torch import save_file

        tensors = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        if self.best is not None:
            tensors.update({f"best.{k}": v for k, v in self.best[2].items()})
        for i, p in enumerate(self.opt.param_groups[0]["params"]):
            st = self.opt.state.get(p)
            if st:
                tensors[f"opt.{i}.step"] = st["step"].reshape(()) if hasattr(st["step"], "reshape") else self.torch.tensor(float(st["step"]))
                tensors[f"opt.{i}.exp_avg"] = st["exp_avg"]
                tensors[f"opt.{i}.exp_avg_sq"] = st["exp_avg_sq"]
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}  # resumable on any device
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.checkpoint.with_name(self.checkpoint.name + ".tmp")
        save_file(tensors, str(tmp))
        tmp.replace(self.checkpoint)
        write_atomic(self.checkpoint.with_suffix(".json"), json.dumps(
            {"config": self.config.__dict__, "examples": self.recipe.identity, "step": self.step,
             "steps": self.steps, "precision": self.precision, "best_score": self.best[0] if self.best else None,
             "best_step": self.best[1] if self.best else None}) + "\n")
        self.saved = self.step

    @contextlib.contextmanager
    def _memory_guard(self):
        """An allocation refused inside (torch's ``OutOfMemoryError`` on a GPU, a refused
        ``malloc`` on the CPU) becomes an error that says where, what to do and what is kept. No
        checkpoint is written then: a step cut short may have moved some weights and not others,
        and the one on disk (at most ``CHECKPOINT_S`` old) is whole."""
        try:
            yield
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            refused = isinstance(exc, (MemoryError, self.torch.OutOfMemoryError))
            if not refused and "DefaultCPUAllocator" not in str(exc):  # the CPU's (worded apart per OS)
                raise
            advice = ("free the GPU's memory (other programs on it, a model loaded in SpecDeck's window) or train "
                      "with --device cpu" if self.device != "cpu" else "close other programs and try again")
            kept = f"the same command goes on from step {self.saved}" if self.saved else "no step is kept yet"
            raise SpecDeckError(f"training ran out of memory on {device_name(self.device)} at step {self.step + 1} "
                                f"of {self.steps or '?'}: {advice}; {kept}") from exc

    # -- training ------------------------------------------------------------------------------
    def _batch(self, step: int) -> np.ndarray:
        """The items of ``step``: epochs are seeded permutations, so any step's batch is fixed."""
        n, batch = self.recipe.n_train, self.config.batch
        per_epoch = max(1, n // batch)
        epoch, i = divmod(step, per_epoch)
        order = np.random.default_rng((self.config.seed, epoch)).permutation(n)
        return order[i * batch : (i + 1) * batch]

    def _loss(self, items: np.ndarray):
        with self._autocast():
            return self.recipe.loss(items, self.step)

    def _autocast(self):
        """The forward's products in bfloat16 where ``precision`` says so (backward follows them)."""
        if self.precision != "bfloat16":
            return contextlib.nullcontext()
        return self.torch.autocast(self.device, dtype=self.torch.bfloat16)

    def agreement(self) -> list[float]:
        self.model.eval()
        with self.torch.no_grad():
            out = self.recipe.agreement()
        self.model.train()
        return out

    def max_steps(self) -> int:
        """``max_epochs`` passes over the training examples: past that a head only memorizes."""
        return max(1, int(self.config.max_epochs * self.recipe.n_train / self.config.batch))

    @staticmethod
    def score(agreement: Sequence[float]) -> float:
        """Tokens a chain of the heads' top guesses would have accepted per step, if heads erred
        independently: a1 + a1 a2 + a1 a2 a3 + ... (what acceptance follows)."""
        total, run = 0.0, 1.0
        for a in agreement:
            run *= a
            total += run
        return total

    def _evaluate(self) -> list[float]:
        """Held-out agreement now; the best state so far is kept for export."""
        agreement = self.agreement()
        score = self.score(agreement)
        if self.best is None or score > self.best[0]:
            self.best = (score, self.step, {k: v.detach().clone() for k, v in self.model.state_dict().items()})
        return agreement

    def measure_step(self) -> float:
        """Seconds one step takes here (on a scratch copy: training itself is not touched). A GPU
        runs one untimed first (kernels load) and is waited for, since it returns before it is done."""
        torch = self.torch
        rows = np.arange(min(self.config.batch, self.recipe.n_train))
        params = [p for p in self.model.parameters() if p.requires_grad]
        settle = torch.cuda.synchronize if self.device != "cpu" else (lambda: None)
        untimed = int(self.device != "cpu")
        start = time.perf_counter()
        with self._memory_guard():
            for i in range(untimed + 3):
                if i == untimed:
                    settle()
                    start = time.perf_counter()
                grads = torch.autograd.grad(self._loss(rows), params)
                del grads
            settle()
        return (time.perf_counter() - start) / 3

    def run(self, steps: int, report: Callable[[Progress], None] | None = None,
            stop: Callable[[], bool] | None = None) -> Progress:
        """Train to ``steps`` in all (a resumed run keeps the step count it started with)."""
        if self.steps == 0:
            self.steps = min(steps, self.max_steps())
        start = last_save = last_report = time.perf_counter()
        first = self.step
        loss_avg = math.nan
        self.model.train()
        while self.step < self.steps:
            if stop is not None and stop():
                break
            with self._memory_guard():
                value, agreement = self._step()
            loss_avg = value if math.isnan(loss_avg) else 0.95 * loss_avg + 0.05 * value
            now = time.perf_counter()
            if now - last_save > CHECKPOINT_S:
                self.save_checkpoint()
                last_save = now
            if report is not None and (now - last_report > 2.0 or agreement or self.step == self.steps):
                done = self.step - first
                eta = (now - start) / done * (self.steps - self.step) if done else 0.0
                report(Progress(self.step, self.steps, loss_avg, agreement, now - start, eta))
                last_report = now
        self.save_checkpoint()
        return Progress(self.step, self.steps, loss_avg, self.best_agreement(), time.perf_counter() - start, 0.0)

    def _step(self) -> tuple[float, list[float]]:
        """One optimizer step, then the held-out evaluation where one is due: (its loss, agreement or [])."""
        loss = self._loss(self._batch(self.step))
        self.opt.zero_grad()
        loss.backward()
        clip = getattr(self.config, "clip", 0.0)
        if clip:
            self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.opt.step()  # Ctrl+C or a kill: the last checkpoint (at most CHECKPOINT_S old) is consistent
        self.step += 1
        due = self.step % self.config.eval_every == 0 or self.step == self.steps
        return loss.item(), self._evaluate() if due else []

    def best_agreement(self) -> list[float]:
        """Held-out agreement of the head that ``export`` writes."""
        if self.best is None:
            return self.agreement()
        current = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.model.load_state_dict(self.best[2])
        agreement = self.agreement()
        self.model.load_state_dict(current)
        return agreement

    def export(self, training: dict) -> HeadFile:
        """The best evaluated head (the last state if none was evaluated) as a head file."""
        state = self.best[2] if self.best is not None else self.model.state_dict()
        config, tensors = self.recipe.export({k: v.detach().cpu() for k, v in state.items()})
        training = dict(training, best_step=self.best[1] if self.best else self.step, precision=self.precision)
        trained = {name for name, _ in self.model.named_parameters()}
        frozen = ("lm.weight",) if "lm" in state and "lm" not in trained else ()  # the target's own rows
        return HeadFile(self.kind, config, self.target, tensors, training, from_target=frozen)


class MedusaRecipe(OnDevice):
    """Medusa-1: K residual heads on one state; examples are answer positions."""

    kept = ("weights",)

    def __init__(self, examples: Examples, vocab: np.ndarray, lm_init: np.ndarray, config: MedusaTrainConfig) -> None:
        torch = self.torch = torch_or_error()
        torch.manual_seed(config.seed)
        self.examples, self.vocab, self.config = examples, vocab, config
        self.model = _module(torch, config.n_heads, examples.states.shape[1], lm_init, config.train_lm)
        self.train_rows = np.flatnonzero(~examples.held_out)
        self.test_rows = np.flatnonzero(examples.held_out)[:4096]
        self.n_train = len(self.train_rows)
        self.identity = len(examples.states)
        self.weights = torch.tensor([config.decay ** k for k in range(config.n_heads)])

    def loss(self, items: np.ndarray, step: int):
        torch = self.torch
        rows = self.train_rows[items]
        x = self.tensor(self.examples.states[rows].astype(np.float32))
        y = self.tensor(self.examples.targets[rows])
        logits = self.model(x)  # [N, K, V']
        per_head = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                     ignore_index=-1, reduction="none").reshape(y.shape)
        mask = (y >= 0).float()
        per_head = (per_head * mask).sum(0) / mask.sum(0).clamp(min=1)
        return (per_head * self.weights).sum() / self.weights.sum()

    def agreement(self) -> list[float]:
        """Held-out top-1 agreement of each head with what the model wrote."""
        rows = self.test_rows if len(self.test_rows) else self.train_rows[:2048]
        logits = self.model(self.tensor(self.examples.states[rows].astype(np.float32)))
        guess = logits.argmax(-1).cpu().numpy()
        y = self.examples.targets[rows]
        return [float((guess[y[:, k] >= 0, k] == y[y[:, k] >= 0, k]).mean()) if (y[:, k] >= 0).any() else 0.0
                for k in range(y.shape[1])]

    def export(self, state: dict) -> tuple[dict, dict[str, np.ndarray]]:
        tensors = {"blocks.w": state["w"].detach().numpy().astype(np.float16),
                   "blocks.b": state["b"].detach().numpy().astype(np.float16),
                   "lm.weight": state["lm"].detach().numpy().astype(np.float16), "vocab": self.vocab.astype(np.int64)}
        config = {"n_heads": self.config.n_heads, "d_model": int(state["w"].shape[1]), "draft_vocab": len(self.vocab)}
        return config, tensors


class MedusaTrainer(HeadTrainer):
    def __init__(self, examples: Examples, vocab: np.ndarray, lm_init: np.ndarray, target: ModelFingerprint,
                 config: MedusaTrainConfig, checkpoint: Path, device: str = "auto") -> None:
        super().__init__(MedusaRecipe(examples, vocab, lm_init, config), KIND, target, config, checkpoint, device)
