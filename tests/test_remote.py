"""The remote backend against real servers: llama-cpp-python's own server on the bundled model
(plain and with its prompt-lookup draft), a fault-injecting proxy in front of it, vLLM's real
metric names and both generations of its launch flags, and llama-server's two flag spellings."""

from __future__ import annotations

import io
import socket
import threading
import time

import pytest

from backends.core.types import Finished, GenerationSettings, Prefilled, Step
from backends.remote.bench import parse_servers, run_server_bench
from backends.remote.client import RemoteClient, RemoteError, ServerConfig, retry_after
from backends.remote.launch import (CONFIG, LEGACY, LaunchError, Parallel, VllmLaunch, llama_server_flags,
                                    llama_server_plan, vllm_generation, vllm_plan)
from backends.remote.metrics import SpecCounters, parse_timings, parse_vllm
from backends.remote.session import REMOTE_TOKEN, RemoteSession
from tests.remote_kit import API_KEY, Proxy, dcgm_text, free_port, start_server, tls_files

GREEDY = GenerationSettings(max_new_tokens=40)
ASK = [{"role": "user", "content": "List the planets of the solar system, one per line."}]


# -- servers (started once per test session) ------------------------------------------------------
@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("servers")
    plain = start_server(tmp)
    try:
        pld = start_server(tmp, draft="prompt-lookup-decoding")
    except BaseException:
        plain.stop()
        raise
    yield {"plain": plain, "pld": pld}
    plain.stop()
    pld.stop()


@pytest.fixture
def proxy(servers):
    p = Proxy(servers["plain"].url)
    yield p
    p.close()


def config(url: str, **kw) -> ServerConfig:
    return ServerConfig(url, api_key=API_KEY, **kw)


def answer(session: RemoteSession, messages=ASK, gen=GREEDY, cancel=None):
    events = list(session.generate(messages, gen, cancel=cancel))
    return events, events[-1]


# -- vLLM metrics (exposition text as vLLM writes it) --------------------------------------------
V1_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 120.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 80.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 720.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 480.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 300.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 200.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct",position="0"} 100.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct",position="1"} 80.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct",position="2"} 60.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct",position="0"} 70.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct",position="1"} 50.0
"""

V0_METRICS = """# HELP vllm:spec_decode_draft_acceptance_rate Speulative token acceptance rate.
# TYPE vllm:spec_decode_draft_acceptance_rate gauge
vllm:spec_decode_draft_acceptance_rate{model_name="Qwen/Qwen2.5-7B-Instruct"} 0.62
# HELP vllm:spec_decode_efficiency Speculative decoding system efficiency.
# TYPE vllm:spec_decode_efficiency gauge
vllm:spec_decode_efficiency{model_name="Qwen/Qwen2.5-7B-Instruct"} 0.41
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{model_name="Qwen/Qwen2.5-7B-Instruct"} 310.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{model_name="Qwen/Qwen2.5-7B-Instruct"} 500.0
# HELP vllm:spec_decode_num_emitted_tokens_total Number of emitted tokens.
# TYPE vllm:spec_decode_num_emitted_tokens_total counter
vllm:spec_decode_num_emitted_tokens_total{model_name="Qwen/Qwen2.5-7B-Instruct"} 410.0
"""


def test_vllm_v1_counters_sum_engines_and_give_acceptance_tau_and_positions():
    now = parse_vllm(V1_METRICS)
    assert now == SpecCounters(drafts=200.0, draft_tokens=1200.0, accepted=500.0, per_position=(170.0, 130.0, 60.0))
    before = SpecCounters(drafts=100.0, draft_tokens=600.0, accepted=200.0, per_position=(100.0, 60.0))
    delta = now.minus(before)
    assert (delta.drafts, delta.drafted, delta.accepted) == (100.0, 600.0, 300.0)
    assert delta.acceptance_rate == pytest.approx(0.5) and delta.tau == pytest.approx(4.0)
    assert delta.acceptance_by_position == pytest.approx((0.7, 0.7, 0.6))
    assert parse_vllm(V1_METRICS, model="another/model") is None  # only that model's series count
    restarted = SpecCounters(drafts=5.0, draft_tokens=30.0, accepted=10.0)
    assert restarted.minus(now).drafted == 30.0  # counters that went down count from zero


def test_vllm_v0_gauges_and_counters_without_a_count_of_drafts():
    counters = parse_vllm(V0_METRICS)
    assert counters.acceptance_rate == pytest.approx(0.62) and counters.efficiency == pytest.approx(0.41)
    assert (counters.drafts, counters.draft_tokens, counters.accepted) == (None, 500.0, 310.0)
    delta = counters.minus(SpecCounters(drafts=None, draft_tokens=100.0, accepted=60.0))
    assert delta.acceptance_rate == pytest.approx(250 / 400) and delta.tau is None
    assert parse_vllm("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n") is None


def test_llama_server_timings_only_count_drafts_when_it_drafted():
    drafted = parse_timings({"predicted_per_second": 81.5, "predicted_n": 64, "prompt_n": 12, "draft_n": 40,
                             "draft_n_accepted": 30})
    assert drafted.predicted_n == 64 and drafted.draft.acceptance_rate == pytest.approx(0.75)
    assert parse_timings({"predicted_per_second": 50.0, "predicted_n": 10}).draft is None
    assert parse_timings("nonsense") is None


def test_dcgm_exporter_figures_become_gpu_samples():
    from backends.remote.metrics import parse_dcgm

    cards = parse_dcgm(dcgm_text({0: 287.5, 1: 120.0}))
    assert [c.index for c in cards] == [0, 1] and cards[0].power_w == 287.5 and cards[1].temperature_c == 56
    assert cards[0].vram_used_bytes == 40960 * 2**20 and cards[0].utilization_pct is None
    assert parse_dcgm(V1_METRICS) == ()


def test_retry_after_reads_seconds_and_http_dates():
    assert retry_after("7") == 7.0
    assert retry_after("Wed, 21 Oct 2015 07:28:30 GMT", now=1445412500.0) == pytest.approx(10.0)
    assert retry_after("soon") is None and retry_after(None) is None


# -- launch commands -----------------------------------------------------------------------------
def test_vllm_launch_in_both_flag_generations():
    eagle3 = VllmLaunch("meta-llama/Llama-3.1-8B-Instruct", "eagle3", draft="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", num_tokens=6)
    argv = vllm_plan(eagle3, generation=CONFIG).server
    assert argv[:3] == ("vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct")
    spec = argv[argv.index("--speculative-config") + 1]
    assert '"method": "eagle3"' in spec and '"num_speculative_tokens": 6' in spec and "yuhuili/EAGLE3" in spec
    with pytest.raises(LaunchError, match="0.8.5"):
        vllm_plan(eagle3, generation=LEGACY)
    ngram = VllmLaunch("Qwen/Qwen2.5-7B-Instruct", "pld", num_tokens=4, ngram_max=5, ngram_min=2)
    old = vllm_plan(ngram, generation=LEGACY).server
    assert old[old.index("--speculative-model") + 1] == "[ngram]" and old[old.index("--ngram-prompt-lookup-max") + 1] == "5"
    assert "--speculative-config" not in old
    new = vllm_plan(ngram, generation=CONFIG).server
    assert '"prompt_lookup_max": 5' in new[-1] and '"method": "ngram"' in new[-1]
    mtp = vllm_plan(VllmLaunch("deepseek-ai/DeepSeek-V3", "mtp", num_tokens=1), generation=LEGACY).server
    assert mtp[-2:] == ("--num-speculative-tokens", "1") and "--speculative-model" not in mtp
    with pytest.raises(LaunchError, match="draft model"):
        vllm_plan(VllmLaunch("m", "draft"), generation=CONFIG)
    assert "--speculative" not in " ".join(vllm_plan(VllmLaunch("m"), generation=CONFIG).server)


def test_vllm_multi_gpu_and_multi_node_and_generation_detection():
    plan = vllm_plan(VllmLaunch("m", "draft", draft="small", parallel=Parallel(tensor=4, pipeline=2, nodes=2,
                                                                                head_address="10.0.0.5")),
                     generation=LEGACY)
    assert plan.steps[0][1][:3] == ("ray", "start", "--head") and "--address=10.0.0.5:6379" in plan.steps[1][1]
    argv = plan.server
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4" and argv[argv.index("--pipeline-parallel-size") + 1] == "2"
    assert argv[argv.index("--speculative-draft-tensor-parallel-size") + 1] == "1"
    assert "ray" in argv and "VLLM_API_KEY" in plan.shell()
    with pytest.raises(LaunchError, match="head"):
        Parallel(nodes=2)
    assert vllm_generation(version="0.7.3") == LEGACY and vllm_generation(version="0.8.2") == LEGACY
    assert vllm_generation(version="0.8.3") == CONFIG and vllm_generation(version="0.11.0") == CONFIG
    assert vllm_generation(help_text="  --speculative-config SPECULATIVE_CONFIG", version="0.7.0") == CONFIG


OLD_LLAMA_HELP = """-md,   --model-draft FNAME              draft model for speculative decoding (default: unused)
--draft-max, --draft, --draft-n N       number of tokens to draft for speculative decoding (default: 16)
--draft-min, --draft-n-min N            minimum number of draft tokens to use for speculative decoding
-ngld, --gpu-layers-draft N             number of layers to store in VRAM for the draft model"""
NEW_LLAMA_HELP = """--spec-draft-model, -md, --model-draft FNAME   draft model for speculative decoding (default: unused)
--spec-type [none|draft-simple|draft-eagle3|draft-mtp|ngram-simple|ngram-map-k|ngram-mod|ngram-cache]
                                        comma-separated list of types of speculative decoding to use
--spec-draft-n-max N                    number of tokens to draft for speculative decoding (default: 16)
--spec-draft-n-min N                    minimum number of draft tokens to use for speculative decoding"""


def test_llama_server_flag_spelling_from_its_help():
    old = llama_server_flags(OLD_LLAMA_HELP)
    assert (old.draft_model, old.draft_max, old.draft_min, old.spec_type) == ("--model-draft", "--draft-max", "--draft-min", None)
    argv = llama_server_plan("t.gguf", flags=old, method="draft", draft="d.gguf", num_tokens=12).server
    assert argv[argv.index("--model-draft") + 1] == "d.gguf" and argv[argv.index("--draft-max") + 1] == "12"
    with pytest.raises(LaunchError, match="cannot run eagle3"):
        llama_server_plan("t.gguf", flags=old, method="eagle3", draft="e.gguf")
    new = llama_server_flags(NEW_LLAMA_HELP)
    assert (new.draft_model, new.draft_max, new.spec_type) == ("--spec-draft-model", "--spec-draft-n-max", "--spec-type")
    assert "draft-eagle3" in new.spec_types and "ngram-simple" in new.spec_types
    argv = llama_server_plan("t.gguf", flags=new, method="eagle3", draft="e.gguf").server
    assert argv[argv.index("--spec-type") + 1] == "draft-eagle3" and "--spec-draft-model" in argv
    pld = llama_server_plan("t.gguf", flags=new, method="pld").server
    assert pld[pld.index("--spec-type") + 1] == "ngram-simple" and "--spec-draft-model" not in pld
    with pytest.raises(LaunchError, match="too old"):
        llama_server_flags("-m FNAME  model path")


# -- a real server -------------------------------------------------------------------------------
def test_chat_streams_from_a_real_server_and_prompt_lookup_changes_nothing(servers):
    with RemoteSession(config(servers["plain"].url + "/v1/")) as plain, RemoteSession(config(servers["pld"].url)) as pld:
        assert plain.info.models and plain.info.model == plain.info.models[0] and not plain.info.counters
        events, done = answer(plain)
        steps = [e for e in events if isinstance(e, Step)]
        assert isinstance(events[0], Prefilled) and isinstance(done, Finished) and len(steps) > 3
        assert "".join(s.text for s in steps) == done.text and done.text.strip()
        assert done.stats.new_tokens >= len(steps) and set(done.tokens) == {REMOTE_TOKEN}
        assert done.reason in ("eos", "length") and done.stats.decode_tok_s > 0
        assert "does not report drafting" in done.stats.declined  # llama-cpp-python's server keeps no counters
        _, drafted = answer(pld)
        assert drafted.text == done.text  # greedy: the server's prompt lookup is lossless
        follow = ASK + [{"role": "assistant", "content": done.text}, {"role": "user", "content": "Which is largest?"}]
        _, second = answer(plain, follow)
        assert second.text and second.text != done.text


def test_cancel_mid_stream_stops_the_answer_and_the_server_keeps_serving(servers):
    cancel = threading.Event()
    with RemoteSession(config(servers["plain"].url)) as session:
        seen = []
        for event in session.generate(ASK, GenerationSettings(max_new_tokens=200), cancel=cancel):
            seen.append(event)
            if sum(isinstance(e, Step) for e in seen) == 3:
                cancel.set()
        assert isinstance(seen[-1], Finished) and seen[-1].reason == "cancelled"
        assert seen[-1].stats.new_tokens <= 4
        _, after = answer(session, gen=GenerationSettings(max_new_tokens=8))
        assert after.reason in ("eos", "length") and after.text


def test_bench_and_terminal_chat_against_real_servers(servers, monkeypatch, capsys):
    rows = parse_servers([servers["plain"].url, "pld=" + servers["pld"].url], api_key=API_KEY)
    assert rows[1].name == "pld" and rows[0].name == servers["plain"].url.removeprefix("http://")  # host:port
    out = io.StringIO()
    result = run_server_bench(rows, per_category=1, categories=("qa", "summarization"), max_new_tokens=24,
                              out=out, progress=io.StringIO())
    assert len(result["records"]) == 4 and "| pld | overall |" in out.getvalue()
    overall = result["summary"]["pld"]["overall"]
    assert overall["prompts"] == 2 and overall["decode_tok_s"] > 0 and result["summary"]["pld"]["qa"]["prompts"] == 1
    # Same text counted prompt by prompt (a Q4_1 near-tie may flip one token between the server's
    # batched and single-token logits, so the count is not asserted to be all of them here)
    same = sum(r["text"] == next(b["text"] for b in result["records"] if b["server"] == rows[0].name
                                 and b["question_id"] == r["question_id"]) for r in result["records"] if r["server"] == "pld")
    assert overall["identical"] == same and result["summary"][rows[0].name]["overall"]["identical"] == 2
    from backends.cli import main

    monkeypatch.setenv("SPECDECK_API_KEY", API_KEY)
    monkeypatch.setattr("sys.stdin", io.StringIO("Say hello.\n/method pld\n"))
    assert main(["chat", "--server", servers["plain"].url, "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out
    assert "assistant> " in printed and "[server · " in printed and "the server decides how it drafts" in printed


# -- faults, through a proxy in front of the real server ---------------------------------------------
def test_a_wrong_key_and_a_dead_address_are_clear_errors(servers):
    with pytest.raises(RemoteError, match="refused the API key") as err:
        RemoteSession(ServerConfig(servers["plain"].url, api_key="wrong"))
    assert err.value.kind == "auth" and "wrong" not in str(err.value)
    with pytest.raises(RemoteError, match="cannot reach") as err:
        RemoteSession(ServerConfig(f"http://127.0.0.1:{free_port()}", retries=1, backoff=0.05))
    assert err.value.kind == "unreachable"
    assert "wrong" not in repr(ServerConfig("http://x", api_key="wrong"))


def test_dropped_stream_keeps_the_text_received(proxy):
    with RemoteSession(config(proxy.url)) as session:
        proxy.faults.plan.append({"drop_after": 10})
        with pytest.raises(RemoteError) as err:
            answer(session)
        assert err.value.kind == "dropped" and err.value.partial and "kept" in str(err.value)
        _, again = answer(session, gen=GenerationSettings(max_new_tokens=8))  # the next request works
        assert again.text


def test_server_errors_and_rate_limits(proxy):
    with RemoteSession(config(proxy.url, backoff=0.05)) as session:
        proxy.faults.plan.append({"status": 500, "body": '{"error": {"message": "CUDA out of memory"}}'})
        with pytest.raises(RemoteError, match="failed.*500.*CUDA out of memory") as err:
            answer(session)
        assert err.value.kind == "server" and err.value.partial == ""
        # 429 with Retry-After, twice: retried after the wait the server asked for, then answered
        proxy.faults.plan += [{"status": 429, "headers": {"Retry-After": "1"}}] * 2
        before = len(proxy.faults.seen)
        _, done = answer(session, gen=GenerationSettings(max_new_tokens=8))
        assert done.text and proxy.faults.seen[before:].count("/v1/chat/completions") == 3
        # a wait longer than the client accepts is reported at once, with the server's figure
        proxy.faults.plan.append({"status": 429, "headers": {"Retry-After": "3600"}})
        with pytest.raises(RemoteError, match="rate-limiting.*3600 s") as err:
            answer(session)
        assert err.value.kind == "rate_limited"


def test_a_server_still_loading_its_model_says_so(proxy):
    proxy.faults.plan.append({"path": "/health", "status": 503,
                              "body": '{"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}'})
    with pytest.raises(RemoteError, match="still loading its model") as err:
        RemoteSession(config(proxy.url))
    assert err.value.kind == "loading"
    with RemoteSession(config(proxy.url)) as session:  # ready now
        assert session.client.health() in (None, "ok") and session.info.models


def test_plain_completions_for_a_model_without_a_chat_template(proxy):
    """Asked through /v1/completions (a base model's way), the conversation goes as a plain
    transcript; with api="auto" a server that refuses a chat for want of a template (vLLM's 400)
    is asked that way from then on, and a 400 for another reason is still an error."""
    with RemoteSession(config(proxy.url, api="completions")) as session:
        events, done = answer(session, gen=GenerationSettings(max_new_tokens=16))
        assert done.text.strip() and "".join(e.text for e in events if isinstance(e, Step)) == done.text
        assert proxy.faults.seen[-1] == "/v1/completions" and "\nUser:" not in done.text
        body = session.request_body(ASK, GREEDY, chat=False)
        assert body["prompt"].startswith("User: ") and body["prompt"].endswith("\nAssistant:") and "\nUser:" in body["stop"]
    refusal = ('{"error": {"message": "As of transformers v4.44, default chat template is no longer allowed, so you must '
               'provide a chat template if the tokenizer does not define one."}}')
    with RemoteSession(config(proxy.url)) as session:
        proxy.faults.plan.append({"status": 400, "body": refusal})
        _, done = answer(session, gen=GenerationSettings(max_new_tokens=8))
        assert done.text and proxy.faults.seen[-2:] == ["/v1/chat/completions", "/v1/completions"]
        answer(session, gen=GenerationSettings(max_new_tokens=4))
        assert proxy.faults.seen[-1] == "/v1/completions"  # remembered for the session
    with RemoteSession(config(proxy.url)) as session:
        proxy.faults.plan.append({"status": 400, "body": '{"error": {"message": "max_tokens is too large"}}'})
        with pytest.raises(RemoteError, match="max_tokens is too large"):
            answer(session)
    with pytest.raises(ValueError, match="API is one of"):
        ServerConfig(proxy.url, api="responses")


def test_a_stalled_stream_is_reported_and_cancel_works_while_waiting(proxy):
    with RemoteSession(config(proxy.url, stall_timeout=1.5)) as session:
        proxy.faults.plan.append({"stall_after": 6, "stall_for": 6})
        with pytest.raises(RemoteError, match="sent nothing for 2 s") as err:
            answer(session)
        assert err.value.kind == "stalled" and err.value.partial
    with RemoteSession(config(proxy.url, stall_timeout=60)) as session:
        proxy.faults.plan.append({"stall_after": 6, "stall_for": 6})
        cancel = threading.Event()
        threading.Timer(0.5, cancel.set).start()  # the user presses Stop while nothing arrives
        events, done = answer(session, cancel=cancel)
        assert done.reason == "cancelled"


def test_tls_with_its_own_certificate_authority(tmp_path):
    ca, key, cert = tls_files(tmp_path)
    server = start_server(tmp_path, tls=(ca, key, cert))
    try:
        with RemoteSession(config(server.url, verify=str(ca))) as session:
            _, done = answer(session, gen=GenerationSettings(max_new_tokens=8))
            assert done.text and session.info.base.startswith("https://")
        with pytest.raises(RemoteError, match="not trusted.*CA certificate file") as err:
            RemoteSession(config(server.url))  # the system's authorities do not know this one
        assert err.value.kind == "tls"
    finally:
        server.stop()


def test_keys_are_kept_per_address_in_an_owner_only_file(tmp_path, monkeypatch):
    import stat

    from backends.remote.keys import key_file, load_key, save_key

    monkeypatch.setenv("SPECDECK_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("SPECDECK_NO_KEYRING", "1")
    where = save_key("http://gpu-box:8000/v1/", "sk-secret")
    assert load_key("http://gpu-box:8000") == "sk-secret" and load_key("http://other:8000") is None
    assert stat.S_IMODE(key_file().stat().st_mode) == 0o600 and "readable by you only" in where
    save_key("http://gpu-box:8000", None)
    assert load_key("http://gpu-box:8000") is None


def test_connecting_is_given_up_at_once_when_stopped():
    """A server that takes connections and never answers holds a connection attempt for its
    timeouts; Stop ends the wait at once (the window's comparison connects to servers this way)."""
    from backends.remote.session import connect

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes the handshake; nothing ever reads or answers
    try:
        cancel = threading.Event()
        threading.Timer(0.3, cancel.set).start()
        started = time.monotonic()
        assert connect(ServerConfig(f"http://127.0.0.1:{silent.getsockname()[1]}", retries=0), cancel) is None
        assert time.monotonic() - started < 3.0  # not the 5 s health wait, nor the 120 s silence allowed
    finally:
        silent.close()


def test_unusable_addresses_are_refused_before_connecting():
    with pytest.raises(ValueError, match="http"):
        ServerConfig("gpu-box:8000")
    assert ServerConfig("http://h:1/v1/").base == "http://h:1"
    client = RemoteClient(ServerConfig("http://127.0.0.1:9"))
    assert client.counters() is None  # no /metrics anywhere: no counters, no error
    client.close()


def test_the_vllm_bench_script_says_what_it_needs_and_starts_nothing_without_it():
    import shutil
    import subprocess
    import sys

    from tests.remote_kit import ROOT

    run = subprocess.run([sys.executable, "packaging/vllm_bench.py", "--model", "no/such-model", "--startup-timeout", "60"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode in (1, 2), run.stderr  # 1: vLLM and a GPU are here, and the made-up model cannot come up
    assert run.returncode == 2 or shutil.which("vllm") is not None
    if run.returncode == 2:
        assert "nothing started" in run.stderr
