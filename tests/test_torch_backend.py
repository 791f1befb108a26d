"""The PyTorch backend against Hugging Face transformers and against its own plain decoding.

transformers reads the same GGUF files (its own dequantizer and modeling code), so the first tests
compare SpecDeck's model with an independent implementation of each family on identical
weights, fp32: logits within 1e-3 on 20 prompts, greedy text identical. The rest run the engine
on the torch target: trees against chains, commit against a fresh prefill, and every kind of
drafter against ``ar`` on the real model, divergences allowed only at measured near-ties.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the test extra installs it; a GGUF-only install has no torch backend

from backends.core.errors import ModelFileError  # noqa: E402
from backends.core.types import FINAL_STATE, Proposal, Verdict  # noqa: E402
from backends.factory import Session, SessionConfig  # noqa: E402
from backends.llamacpp.model import LlamaModel  # noqa: E402
from backends.pytorch.loader import open_torch_target  # noqa: E402
from backends.pytorch.weights import load_weights  # noqa: E402
from tests.conftest import PROMPTS  # noqa: E402
from tests.test_real_models import answer, same_or_near_tie  # noqa: E402

MORE_PROMPTS = [
    "Name three primary colors.",
    "Write one sentence about the ocean.",
    "def fib(n):\n    # return the n-th Fibonacci number\n",
    "What is 12 times 12?",
    "Give a synonym for 'happy'.",
    "Describe a cat in five words.",
    "Which planet is closest to the sun?",
    "Complete: The quick brown fox",
    "Write a SQL query that counts the rows of a table named users.",
    "Say hello in Spanish, French and Italian.",
]
TWENTY = PROMPTS + MORE_PROMPTS


@functools.cache
def reference(folder, name):
    """transformers' own model read from the GGUF (once per run: it takes 20-40 s; tests only read it)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, dtype=torch.float32).eval()


def write_hf_folder(model, folder):
    """What a Hub download of the model holds: config.json and the weights in two safetensors shards
    (transformers will not save a model it read from a GGUF itself)."""
    from safetensors.torch import save_file

    folder.mkdir()
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    names = sorted(state)
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        save_file({k: state[k] for k in part}, str(folder / f"model-0000{i + 1}-of-00002.safetensors"))
    return folder


def torch_target(path, **kw):
    vocab = LlamaModel(path, vocab_only=True)
    target = open_torch_target(path, token_piece=vocab.token_piece, eog_ids=vocab.eog_ids, n_ctx=1024,
                               **{"dtype": "float32", **kw})
    return vocab, target


def full_logits(target, tokens) -> np.ndarray:
    """Logits of every position of ``tokens`` from an empty cache, [n, vocab]."""
    target.reset()
    n = len(tokens)
    logits, _ = target._forward(tokens, np.arange(n), np.tril(np.ones((n, n), dtype=bool)), logits_rows=None)
    target._tokens = list(tokens)
    return logits.numpy()


@pytest.mark.parametrize("fixture", ["smollm_f16_path", "gemma_f16_path"], ids=["smollm2-f16", "gemma3-f16"])
def test_float16_weights_keep_float32_activations_and_give_the_float32_logits(fixture, request):
    """float16 weights, as the loader runs them: the residual stream stays float32 (Gemma-3-270M's
    passes float16's 65504, so a float16 residual gives NaN logits) and attention runs in float32 on
    the CPU; the logits stay within 0.25 of float32's (measured: 0.09 on both models; bfloat16's
    1.7), and the greedy tokens are the same."""
    from backends.pytorch.loader import activation_dtype, attention_dtype

    path = request.getfixturevalue(fixture)
    vocab, exact = torch_target(path)
    _, half = torch_target(path, dtype="float16")
    assert half.model.dtype == torch.float16 and half.model.w["output"].dtype == torch.float16
    assert half.model.activation_dtype == activation_dtype(torch.float16) == torch.float32
    assert half.model.attention_dtype == attention_dtype(torch.device("cpu"), torch.float16) == torch.float32
    worst, same = 0.0, 0
    for text in TWENTY[:8]:
        tokens = vocab.chat_prompt([{"role": "user", "content": text}])
        ours, ref = full_logits(half, tokens), full_logits(exact, tokens)
        assert np.isfinite(ours).all(), f"float16 weights gave non-finite logits for {text!r}"
        worst = max(worst, float(np.abs(ours - ref).max()))
        same += int((ours.argmax(-1) == ref.argmax(-1)).all())
    assert worst < 0.25, f"float16 weights' logits differ from float32's by up to {worst}"
    assert same == 8, f"the greedy token differs from float32's somewhere in {8 - same} of 8 prompts"


def test_auto_on_a_cpu_takes_the_weight_type_with_the_fastest_one_row_product():
    """``auto`` on a CPU is whichever of float16, bfloat16 and float32 multiplies one row fastest
    here (timed once per process), and a model opened with it computes as that type requires."""
    from backends.pytorch.loader import DTYPES, cpu_weight_dtype, device_and_dtype

    chosen = cpu_weight_dtype()
    assert chosen in (torch.float16, torch.bfloat16, torch.float32)
    assert str(chosen).removeprefix("torch.") in DTYPES
    assert device_and_dtype("auto", "cpu") == (torch.device("cpu"), chosen)
    assert cpu_weight_dtype() is chosen  # measured once


@pytest.mark.parametrize("fixture", ["smollm_f16_path", "gemma_path"], ids=["smollm2-f16", "gemma3-q4_k_m"])
def test_logits_and_greedy_text_equal_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    vocab, target = torch_target(path)
    ref = reference(path.parent, path.name)
    worst = 0.0
    for text in TWENTY:
        tokens = vocab.chat_prompt([{"role": "user", "content": text}])
        ours = full_logits(target, tokens)
        with torch.no_grad():
            theirs = ref(torch.tensor([tokens])).logits[0].numpy()
        worst = max(worst, float(np.abs(ours - theirs).max()))
    assert worst < 1e-3, f"logits differ from transformers' by up to {worst}"
    for text in TWENTY[:3]:
        tokens = vocab.chat_prompt([{"role": "user", "content": text}])
        with torch.no_grad():
            theirs = ref.generate(torch.tensor([tokens]), max_new_tokens=24, do_sample=False)[0, len(tokens):].tolist()
        target.reset()
        target.prefill(tokens[:-1])
        root, ours = tokens[-1], []
        while len(ours) < len(theirs):
            root = target.extend([root]).top(0)
            ours.append(root)
        assert ours == theirs, f"greedy text differs from transformers' for {text!r}"


def test_a_hugging_face_folder_loads_and_bad_folders_are_refused(smollm_f16_path, smollm_hf_folder, tmp_path):
    """A folder as the Hub has it (config.json, safetensors shards, tokenizer.json, the chat template)
    gives the GGUF's weights, the same chat prompts and token bytes, and the same answer through a
    session; llama.cpp refuses it naming the backend that runs it. A folder with pickled weights
    only, one that needs remote code and an unknown family are refused."""
    folder = smollm_hf_folder(tmp_path / "smollm2")
    shape_f, from_folder = load_weights(folder)
    shape_g, from_gguf = load_weights(smollm_f16_path)
    assert (shape_f.n_layer, shape_f.d, shape_f.n_head, shape_f.n_kv) == (shape_g.n_layer, shape_g.d, shape_g.n_head, shape_g.n_kv)
    assert from_folder.keys() == from_gguf.keys()
    assert all(torch.equal(from_folder[k].float(), from_gguf[k]) for k in from_gguf)

    answers = []
    for model in (str(folder), str(smollm_f16_path)):
        with Session(SessionConfig(model=model, backend="torch", dtype="float32", n_ctx=1024)) as session:
            prompts = [session.model.chat_prompt([{"role": "user", "content": t}]) for t in PROMPTS]
            pieces = [session.model.detokenize(p) for p in prompts]
            answers.append((prompts, pieces, answer(session, "ar", prompts[3]).text))
    assert answers[0] == answers[1]
    with pytest.raises(ModelFileError, match="PyTorch backend runs it"):
        Session(SessionConfig(model=str(folder)))

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((folder / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelFileError, match="pickled weights"):
        load_weights(pickled)
    config = json.loads((folder / "config.json").read_text())
    for name, change, why in (("remote", {"auto_map": {"AutoModel": "x.Y"}}, "remote code"),
                              ("mamba", {"model_type": "mamba"}, "not 'mamba'")):
        bad = tmp_path / name
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ModelFileError, match=why):
            load_weights(bad)


def test_heads_for_a_hugging_face_folder_are_found_trained_and_decode_like_plain_greedy(smollm_f16_path, smollm_hf_folder,
                                                                                         tmp_path, monkeypatch):
    """A folder's fingerprint is the GGUF's (same family, sizes and token texts), so the heads shipped
    for SmolLM2 serve a SmolLM2 folder; ``specdeck train`` records a folder's answers on the PyTorch
    backend and reads its embeddings and output rows from the safetensors shards; both heads decode
    as plain greedy does (or part at a measured near-tie)."""
    from backends.heads.files import HeadFile, ModelFingerprint
    from backends.models.weights import TokenEmbeddings, tensor_rows
    from backends.train import TrainRequest, train

    monkeypatch.setenv("SPECDECK_DATA_DIR", str(tmp_path / "data"))
    folder = smollm_hf_folder(tmp_path / "smollm2")
    mine, gguf = ModelFingerprint.of(folder), ModelFingerprint.of(smollm_f16_path)
    assert not mine.differences(gguf) and mine.file_type != gguf.file_type and mine.name == "smollm2"
    rows = np.array([0, 17, 4000, 49151])
    assert np.array_equal(TokenEmbeddings(folder)(rows), TokenEmbeddings(smollm_f16_path)(rows))
    assert np.array_equal(tensor_rows(folder, rows), tensor_rows(smollm_f16_path, rows))  # tied: the embeddings

    made = train(TrainRequest("medusa", str(folder), prompts=1, steps=2, minutes=2, max_new_tokens=12, follow_ups=0,
                              out=tmp_path / "heads" / "smollm2.medusa"))
    head = HeadFile.load(made)
    assert head.target.name == "smollm2" and head.training["data"] == "spec-bench" and head.kind == "medusa"
    with Session(SessionConfig(model=str(folder), backend="torch", dtype="float32", n_ctx=1024)) as session:
        assert {"eagle", "medusa", "mtp", "eagle3"} <= set(session.head_kinds)  # the shipped SmolLM2 heads
        prompts = [session.model.chat_prompt([{"role": "user", "content": t}]) for t in PROMPTS[:2]]
        for method, settings in (("eagle2", {"adaptive": False, "max_nodes": 8}),
                                 ("medusa", {"adaptive": False, "width": 2, "max_nodes": 4, "head": str(made)})):
            for prompt in prompts:
                ref = answer(session, "ar", prompt)
                same_or_near_tie(session, method, prompt, answer(session, method, prompt, settings), ref)


def test_a_tree_verify_equals_its_paths_verified_as_chains_and_commit_keeps_the_path(smollm_f16_path):
    vocab, target = torch_target(smollm_f16_path)
    prompt = vocab.chat_prompt([{"role": "user", "content": PROMPTS[0]}])
    parents = (-1, 0, 0, 1, 1, 2, -1)  # two roots' children, branching twice
    tokens = (510, 1130, 2213, 29, 3046, 1141, 822)
    target.prefill(prompt[:-1], hidden=True, layers=(2, FINAL_STATE))
    tree = target.verify(prompt[-1], Proposal(tokens, parents))
    for leaf_path in ((0, 1, 3), (0, 1, 4), (0, 2, 5), (6,)):
        target.truncate(len(prompt) - 1)
        chain = target.verify(prompt[-1], Proposal.chain([tokens[i] for i in leaf_path]))
        target.commit(Verdict((), (1,), len(leaf_path), len(leaf_path)))
        rows = [0, *(i + 1 for i in leaf_path)]
        assert np.abs(tree.logits[rows] - chain.logits).max() < 1e-4
        assert np.abs(tree.hidden[rows] - chain.hidden).max() < 1e-3
    # keep the path root -> 0 -> 2 -> 5: the cache must then hold what a fresh prefill computes
    target.truncate(len(prompt) - 1)
    target.verify(prompt[-1], Proposal(tokens, parents))
    target.commit(Verdict((0, 2, 5), (tokens[0], tokens[2], tokens[5], 7), 7, 3))
    text = prompt + [tokens[0], tokens[2], tokens[5]]
    after = target.verify(7, Proposal.chain([8]))
    states = target.hidden_states(len(prompt) - 1, len(text))
    fresh = full_logits(target, text + [7, 8])
    assert np.abs(after.logits - fresh[len(text) :]).max() < 1e-4
    target.reset()
    target.prefill(text, hidden=True, layers=(2, FINAL_STATE))
    assert np.abs(states - target.hidden_states(len(prompt) - 1, len(text))).max() < 1e-3


@pytest.fixture(scope="module")
def torch_session(smollm_f16_path, smollm_q4_path):
    """SmolLM2 F16 on the torch backend, with the Q4_1 file as a llama.cpp draft model beside it."""
    with Session(SessionConfig(model=str(smollm_f16_path), draft_model=str(smollm_q4_path), n_ctx=2048,
                               backend="torch", dtype="float32")) as s:
        yield s


# Fixed sizes: every step drafts, so verification and rollback run on every step.
TORCH_METHODS = [
    ("pld", {"adaptive": False}),
    ("draft", {"adaptive": False, "tree_width": 3, "min_confidence": 0.0, "max_draft": 4}),
    ("eagle2", {"adaptive": False, "max_nodes": 12}),
    ("eagle3", {"adaptive": False, "max_nodes": 12}),
    ("mtp-trained", {"adaptive": False, "max_nodes": 8}),
    ("medusa", {"adaptive": False, "width": 3, "max_nodes": 6}),
    ("lookahead", {}),
    ("self", {"adaptive": False, "skip": "4,12,17", "max_draft": 4, "min_confidence": 0.0}),
    ("specinfer", {"adaptive": False}),
    ("rest", {"adaptive": False}),  # the datastore: the answers themselves (every guess can be right)
    ("auto", {}),  # it may rightly play plain decoding here: only its output is checked
]


def test_every_kind_of_drafter_runs_on_the_torch_backend_and_matches_plain_greedy(torch_session, tmp_path):
    """Text guesses, retrieval, a llama.cpp draft model, EAGLE, EAGLE-3, MTP and Medusa heads
    reading torch's states, layer skipping, merged trees and auto all run unchanged; each output is
    ``ar``'s or parts from it at a measured near-tie."""
    from backends.models.datastore import write_datastore

    assert "PyTorch" in torch_session.placement
    prompts = [torch_session.model.chat_prompt([{"role": "user", "content": t}]) for t in PROMPTS[:4]]
    refs = [answer(torch_session, "ar", p) for p in prompts]
    store = tmp_path / "answers.sdstore"
    write_datastore([(str(i), list(r.tokens)) for i, r in enumerate(refs)], store,
                    vocab=torch_session.model.vocab_info, model_name=torch_session.model.name)
    for method, settings in TORCH_METHODS:
        settings = {**settings, "datastore": str(store)} if method == "rest" else settings
        exact, accepted = 0, 0
        for prompt, ref in zip(prompts, refs):
            got = answer(torch_session, method, prompt, settings)
            accepted += got.stats.accepted
            exact += same_or_near_tie(torch_session, method, prompt, got, ref)
        assert exact >= len(prompts) - 1, f"{method}: only {exact} of {len(prompts)} outputs identical"
        assert accepted > 0 or method == "auto", f"{method} never had a guess accepted on the torch backend"


def test_the_skip_search_keeps_the_first_and_last_layer_and_picks_by_predicted_speed(torch_session):
    """Where drafting were cheap and verifying free, leaving layers out would pay and the search picks
    a set, never the first or last layer, with the agreement it reports; at this model's real
    price (a layer of 30 saves 2.6% of a forward, and leaving out one costs 10-80% of agreement)
    nothing pays, and the search says so."""
    from backends.drafters.self_spec import SelfSettings, predicted_speed, search_skip, top_tokens

    target = torch_session.target
    text = torch_session.model.chat_prompt([{"role": "user", "content": PROMPTS[0]}])[-48:]

    def make(skip):
        return target.skipping(skip, n_ctx=len(text) + 1)

    free = search_skip(make, text, n_layer=target.n_layer, draft_cost=lambda k: 0.1, verify=[1.0] * 9, max_draft=8)
    assert free.skip and 0 not in free.skip and target.n_layer - 1 not in free.skip
    reference = top_tokens(make(()), text)
    assert free.agreement == pytest.approx(float(np.mean(top_tokens(make(free.skip), text) == reference)))
    assert free.speed == pytest.approx(predicted_speed(free.agreement, 0.1, [1.0] * 9, 8)) and free.speed > 1.5
    real = search_skip(make, text, n_layer=target.n_layer, verify=[1.0 + 0.1 * g for g in range(9)], max_draft=8,
                       draft_cost=lambda k: 1 - target.layer_share * k / target.n_layer)
    assert real.skip == () and real.speed == 1.0
    with pytest.raises(ValueError, match="layer numbers"):
        SelfSettings(skip="4,x")


def test_the_skip_plan_is_kept_for_the_next_session(torch_session, tmp_path):
    """A search's plan goes to the model's kept file; a new session's drafter starts from it
    without searching; a file that does not fit the model is ignored."""
    from backends.core.types import SamplingSettings
    from backends.drafters.self_spec import SelfDrafter, SelfSettings, SelfState, SkipPlan

    kept = tmp_path / "skip.json"
    prompt = torch_session.model.chat_prompt([{"role": "user", "content": PROMPTS[0]}])

    def drafter(state):
        return SelfDrafter(SelfSettings(probe_tokens=16), target=torch_session.target, sampling=SamplingSettings(),
                           target_vocab=torch_session.model.n_vocab, costs=torch_session.cost_model(), state=state,
                           kept=kept)

    first = SelfState()
    drafter(first).begin(prompt)
    assert first.searches == 1 and SkipPlan.load(kept, torch_session.target.n_layer) == first.plan
    kept.write_text('{"skip": [3, 7], "agreement": 0.9, "speed": 1.3}')  # as if an earlier session found it
    later = SelfState()
    d = drafter(later)
    d.begin(prompt)
    assert later.searches == 0 and later.plan == SkipPlan((3, 7), 0.9, 1.3) and "without 2 of" in d.playing
    kept.write_text('{"skip": [0, 99], "agreement": 0.9, "speed": 1.3}')  # another model's layers
    assert SkipPlan.load(kept, torch_session.target.n_layer) is None


def test_self_is_refused_on_llama_cpp_with_the_reason(smollm_session):
    from backends.core.errors import SpecDeckError
    from backends.core.types import SamplingSettings

    with pytest.raises(SpecDeckError, match="leave layers out|subset of the model's layers"):
        smollm_session.drafter("self", SamplingSettings())


def test_an_unknown_backend_is_refused_by_name():
    from backends.core.errors import SpecDeckError

    with pytest.raises(SpecDeckError, match="unknown backend 'tpu'"):
        Session(SessionConfig(model="smollm2-135m-q4_1", backend="tpu"))


@pytest.mark.parametrize("fixture", ["smollm_q4_path", "gemma_path"], ids=["smollm2-q4_1", "gemma3-q4_k_m"])
def test_the_fit_estimate_of_a_gguf_on_torch_counts_the_dequantized_weights(fixture, request):
    """The library's fit column for "Run with: PyTorch" sizes the weights the torch model really
    holds (float32 here, whatever the file's quantization), within 1%."""
    from backends.hardware.shape import as_torch, load_shape

    path = request.getfixturevalue(fixture)
    shape, weights = load_weights(path)
    held = sum(w.numel() * 4 for w in weights.values())
    estimate = as_torch(load_shape(path), 4).weights_bytes
    assert abs(estimate - held) / held < 0.01, f"estimated {estimate / 2**20:.1f} MiB, the model holds {held / 2**20:.1f} MiB"


def test_the_fit_estimate_on_torch_counts_the_cpu_kv_cache_in_float32(smollm_f16_path):
    """Half-precision weights on a CPU attend in float32: the fit's KV term for "Run with: PyTorch"
    is the cache the target really allocates (to llama.cpp's 256-slot padding), not half of it."""
    from backends.hardware.fit import RuntimeSettings, kv_layer_bytes
    from backends.hardware.shape import as_torch, load_shape

    _, target = torch_target(smollm_f16_path, dtype="float16")
    held = sum(t.numel() * t.element_size() for t in (target.cache.k, target.cache.v))  # n_ctx 1024
    shape = as_torch(load_shape(smollm_f16_path), 2, 4)
    estimate = sum(kv_layer_bytes(shape, RuntimeSettings(n_ctx=1024), il) for il in range(shape.n_layer))
    assert estimate == held, f"estimated {estimate / 2**20:.1f} MiB of KV cache, the target holds {held / 2**20:.1f} MiB"


def test_the_bench_runs_the_torch_backend_beside_llama_cpp_and_transformers(smollm_f16_path, tmp_path):
    """``--backend torch``: ar and pld on the torch model, llama.cpp's ar and transformers' generate
    beside them in the same run; torch's ar and transformers' greedy text agree (same weights,
    fp32), and every row is checked against the torch ar."""
    import io
    from pathlib import Path

    from backends.bench import BenchConfig, run_bench

    sample = Path(__file__).parent / "data" / "spec_bench_sample.jsonl"
    config = BenchConfig(model=str(smollm_f16_path), methods=("ar", "pld", "llamacpp:ar", "hf-ar"), prompts=sample,
                         per_category=1, categories=("translation",), max_new_tokens=24, backend="torch", dtype="float32")
    out = io.StringIO()
    result = run_bench(config, out=out, progress=out)
    rows = {(r["method"], r["question_id"]): r for r in result["records"]}
    assert {m for m, _ in rows} == {"ar", "pld", "llamacpp:ar", "hf-ar"}
    for (method, _), record in rows.items():
        assert record["new_tokens"] > 0 and record["decode_tok_s"] > 0
        if method in ("pld", "hf-ar"):
            assert record["matches_ar"] or record["divergence"]["near_tie"], f"{method}: {record['divergence']}"
    assert "llamacpp:ar" in out.getvalue() and "hf-ar" in out.getvalue()


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampling"])
def test_logits_left_on_the_device_give_the_same_verdicts(temperature):
    """A GPU's logits stay there (``TorchLogits``: only top tokens and sampled rows cross): the
    acceptance rules decide exactly as with the host array, for chains and trees, greedy and
    sampled (checked on CPU tensors, the same code path minus the device)."""
    from backends.core.acceptance import accept
    from backends.core.types import SamplingSettings, TargetOutput
    from backends.pytorch.target import TorchLogits

    rng = np.random.default_rng(0)
    accepted = 0
    for trial in range(40):
        logits = rng.normal(size=(7, 50)).astype(np.float32) * 3
        parents = (-1, 0, 1, 2, 3, 4) if trial % 2 else (-1, 0, 0, 1, 2, -1)
        tokens = [int(t) for t in rng.integers(0, 50, size=6)]
        for i, parent in enumerate(parents):  # most guesses are the target's top token: long paths get accepted
            if rng.random() < 0.7:
                tokens[i] = int(np.argmax(logits[parent + 1]))
        proposal = Proposal(tuple(tokens), parents)
        sampling = SamplingSettings(temperature=temperature, seed=trial)
        verdicts = [accept(TargetOutput(logits=x), proposal, settings=sampling, rng=np.random.default_rng(trial), history=[1, 2])
                    for x in (logits, TorchLogits(torch.from_numpy(logits)))]
        assert verdicts[0] == verdicts[1]
        accepted += verdicts[0].accepted
    assert accepted > 20  # the rules did walk down the trees
