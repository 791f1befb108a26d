"""The window against a real server (llama-cpp-python's own, on the bundled model): connect
through the dialog, chat with live charts, compare; and the ways a server fails, through a proxy:
each a banner in words, nothing the user wrote or saw lost, the window working on."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402
from PySide6.QtCore import QTimer  # noqa: E402

from backends.remote.client import ServerConfig  # noqa: E402
from desktop.main_window import saved_servers, with_saved_key  # noqa: E402
from tests.desktop_kit import ANSWER_TIMEOUT, LOAD_TIMEOUT, Recorder, close_window, open_window, send, shown  # noqa: E402
from tests.remote_kit import API_KEY, Proxy, dcgm_text, free_port, start_server  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("server"))
    yield s
    s.stop()


@pytest.fixture
def window(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECK_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("SPECDECK_NO_KEYRING", "1")  # the key goes to the owner-only file under the test's data dir
    w = open_window(qtbot, tmp_path, autoload=None)
    yield w
    close_window(w)


def connect(qtbot, window, url: str) -> None:
    window.connect_server(ServerConfig(url, api_key=API_KEY))
    qtbot.waitUntil(lambda: window.model is not None and window.model.server and not window.busy, timeout=LOAD_TIMEOUT)


def test_connect_through_the_dialog_chat_with_charts_and_compare(qtbot, window, server):
    window._server_clicked()
    dialog = window.connect_dialog
    dialog.url.setText(server.url)
    dialog.key.setText(API_KEY)
    dialog.check()
    qtbot.waitUntil(lambda: dialog.connect_button.isEnabled(), timeout=30_000)
    assert dialog.models.count() == 1 and "OpenAI-compatible" in dialog.status.text()
    dialog.connect_button.click()
    qtbot.waitUntil(lambda: window.model is not None and window.model.server == server.url and not window.busy,
                    timeout=LOAD_TIMEOUT)
    assert "(server)" in window.status_label.text() and window.server_button.text() == "Disconnect"
    assert not window.methods.isEnabled()  # the server drafts as it was started
    recorder = Recorder(window)
    send(qtbot, window, "Name three primary colors.")
    qtbot.waitUntil(recorder.done, timeout=ANSWER_TIMEOUT)
    assert recorder.steps > 3 and shown(window.chat)[-1][0] == "assistant" and shown(window.chat)[-1][1].strip()
    assert window.charts.series["tau"] or window.charts.runs  # the live charts got the server's steps
    compare = window.compare
    compare.prompt.setPlainText("Say hello.")
    compare.run()
    qtbot.waitUntil(lambda: not compare.running, timeout=ANSWER_TIMEOUT)
    name = ServerConfig(server.url).name  # host:port
    assert compare.table.rowCount() == 1 and compare.table.item(0, 0).text() == name
    assert compare.texts[name].strip() and compare.panes[name].toPlainText() == compare.texts[name]
    window.server_button.click()  # Disconnect: no local model was loaded
    qtbot.waitUntil(lambda: window.model is None, timeout=10_000)
    assert window.server_button.text().startswith("Connect")


def test_a_dead_address_or_a_wrong_key_is_a_banner_and_the_window_goes_on(qtbot, window, server):
    window.connect_server(ServerConfig(f"http://127.0.0.1:{free_port()}", retries=0))
    qtbot.waitUntil(lambda: window.banner.isVisible() and not window.busy, timeout=30_000)
    assert "Could not connect" in window.banner.text() and "cannot reach" in window.banner.text()
    assert window.model is None
    window.dismiss_error()
    window.connect_server(ServerConfig(server.url, api_key="not-the-key"))
    qtbot.waitUntil(lambda: window.banner.isVisible() and not window.busy, timeout=30_000)
    assert "refused the API key" in window.banner.text() and "not-the-key" not in window.banner.text()
    connect(qtbot, window, server.url)  # the right key: connected, the error gone
    assert not window.banner.isVisible()


def test_server_failures_lose_nothing_and_the_window_stays_responsive(qtbot, window, server):
    proxy = Proxy(server.url)
    try:
        connect(qtbot, window, proxy.url)
        # 500 before any text: the message goes back into the box, the banner says why
        proxy.faults.plan.append({"status": 500, "body": '{"error": {"message": "out of memory"}}'})
        send(qtbot, window, "Name three primary colors.")
        qtbot.waitUntil(lambda: window.banner.isVisible() and not window.busy, timeout=ANSWER_TIMEOUT)
        assert "500" in window.banner.text() and "out of memory" in window.banner.text()
        assert window.chat.input.toPlainText() == "Name three primary colors." and not shown(window.chat)
        # dropped mid-answer: the text received stays as the answer
        proxy.faults.plan.append({"drop_after": 8})
        window.chat.input.clear()
        send(qtbot, window, "List the planets.")
        qtbot.waitUntil(lambda: not window.busy and not window.chat.streaming, timeout=ANSWER_TIMEOUT)
        assert "kept" in window.banner.text()  # "... the N characters received are kept"
        assert shown(window.chat)[0] == ("user", "List the planets.") and shown(window.chat)[1][1].strip()
        # stalled: the GUI thread keeps running (a timer fires) and Stop ends the answer at once
        proxy.faults.plan.append({"stall_after": 6, "stall_for": 8})
        ticks = []
        timer = QTimer()
        timer.timeout.connect(lambda: ticks.append(1))
        timer.start(20)
        window.chat.input.clear()
        send(qtbot, window, "Count to ten.")
        qtbot.waitUntil(lambda: len(ticks) > 25, timeout=10_000)  # half a second of a stalled server
        window.stop()
        qtbot.waitUntil(lambda: not window.busy and not window.chat.streaming, timeout=5_000)
        timer.stop()
        assert window.model is not None and window.model.server
    finally:
        proxy.close()


def test_how_patient_to_be_is_set_in_the_dialog_and_kept(qtbot, window, server):
    """A stalled server is given up on after the silence the user chose, not the default 120 s."""
    proxy = Proxy(server.url)
    try:
        window._server_clicked()
        dialog = window.connect_dialog
        assert (dialog.patience.value(), dialog.retries.value()) == (120, 3)  # the defaults, said in the dialog
        dialog.url.setText(proxy.url)
        dialog.key.setText(API_KEY)
        dialog.patience.setValue(5)
        dialog.retries.setValue(0)
        dialog.check()
        qtbot.waitUntil(lambda: dialog.connect_button.isEnabled(), timeout=30_000)
        dialog.connect_button.click()
        qtbot.waitUntil(lambda: window.model is not None and window.model.server and not window.busy, timeout=LOAD_TIMEOUT)
        proxy.faults.plan.append({"stall_after": 6, "stall_for": 30})
        send(qtbot, window, "Count to ten.")
        qtbot.waitUntil(lambda: not window.busy and not window.chat.streaming, timeout=20_000)  # 5 s of silence, not 120
        assert "sent nothing for 5 s" in window.banner.text(), window.banner.text()
        window.server_button.click()  # Disconnect
        qtbot.waitUntil(lambda: window.model is None, timeout=10_000)
        window._server_clicked()
        again = window.connect_dialog
        assert (again.patience.value(), again.retries.value()) == (5, 0)  # kept for next time
        again.reject()
    finally:
        proxy.close()


def test_a_servers_gpus_are_charted_while_connected(qtbot, window, server):
    proxy = Proxy(server.url)
    proxy.metrics_text = dcgm_text({0: 287.5})  # the server exports dcgm-exporter's GPU figures
    try:
        local_title = window.charts.gpu_title
        connect(qtbot, window, proxy.url)
        assert window.model.gpu_metrics == proxy.url + "/metrics"
        assert window.charts.has_gpu and window.charts.gpu_title == "server GPU" and window.charts.gpu is not None
        qtbot.waitUntil(lambda: window.charts.points("gpu_w") > 0, timeout=10_000)
        assert window.charts.series["gpu_w"][-1][1] == 287.5 and window.charts.series["vram_gib"][-1][1] == 40.0
        window.server_button.click()  # Disconnect: this PC's GPUs (or none) again
        qtbot.waitUntil(lambda: window.model is None, timeout=10_000)
        assert window.charts.gpu_title == local_title and window.charts.has_gpu == window.sampler.has_gpu
    finally:
        proxy.close()


def test_loading_a_model_leaves_the_server_and_a_failed_load_keeps_it(qtbot, window, server, tmp_path):
    connect(qtbot, window, server.url)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)  # a header and nothing else
    window.load_model(str(broken), 1024)
    qtbot.waitUntil(lambda: window.banner.isVisible() and not window.busy, timeout=LOAD_TIMEOUT)
    assert window.model.server == server.url  # the server still answers
    window.load_model("smollm2-135m-q4_1", 1024)
    qtbot.waitUntil(lambda: window.model is not None and not window.model.server and not window.busy, timeout=LOAD_TIMEOUT)
    assert window.worker.remote is None and window.server_button.text().startswith("Connect")
    assert window.methods.isEnabled()


def test_compare_runs_the_prompt_on_several_servers(qtbot, window, server):
    """Servers launched with different methods are compared as methods are locally: the connected
    one is the baseline, another is added through the dialog, one that is down gets a row saying
    why, and the list is kept for the next start."""
    proxy = Proxy(server.url)  # a second address (the same engine behind it)
    dead = ServerConfig(f"http://127.0.0.1:{free_port()}", retries=0)
    try:
        connect(qtbot, window, server.url)
        compare = window.compare
        assert not compare.servers_box.isHidden() and compare.methods_box.isHidden()
        assert window.tabs.tabText(window.tabs.indexOf(compare)) == "Compare servers"
        compare.add_server_button.click()
        dialog = window.connect_dialog
        assert dialog.connect_button.text() == "Add"
        dialog.url.setText(proxy.url)
        dialog.key.setText(API_KEY)
        dialog.check()
        qtbot.waitUntil(lambda: dialog.connect_button.isEnabled(), timeout=30_000)
        dialog.connect_button.click()
        compare.add_server(dead)
        first, second = ServerConfig(server.url).name, ServerConfig(proxy.url).name
        assert [c.name for c in compare.chosen_servers()] == [second, dead.name]
        compare.prompt.setPlainText("Say hello.")
        compare.run()
        qtbot.waitUntil(lambda: not compare.running, timeout=ANSWER_TIMEOUT)
        rows = {compare.table.item(r, 0).text(): [compare.table.item(r, c).text() for c in range(8)]
                for r in range(compare.table.rowCount())}
        assert list(rows) == [first, second, dead.name]
        assert rows[first][2] == "1.00x" and rows[second][2].endswith("x") and float(rows[second][1]) > 0
        same = compare.texts[second] == compare.texts[first]  # a Q4_1 near-tie may part them: the verdict must say which
        assert rows[second][7] == ("yes" if same else "NO") and compare.table.horizontalHeaderItem(7).text() == "same text as 1st"
        assert rows[dead.name][7].startswith("failed: cannot reach") and compare.texts[first].strip()
        assert "could not run" in compare.panes[dead.name].toPlainText()  # every server has its pane
        assert compare.table.horizontalHeaderItem(0).text() == "server"
        kept = [(config.url, ticked) for config, ticked in saved_servers(window.settings)]
        assert kept == [(proxy.url, True), (dead.url, True)]
        assert saved_servers(window.settings)[1][0].retries == 0  # each server's patience kept with it
        restored = saved_servers(window.settings)[0][0]
        assert restored.api_key is None and with_saved_key(restored).api_key == API_KEY  # remembered by the dialog
        window.settings.setValue("server/compare", '[{"url": "ftp://x"}, 3, "not a server"]')
        assert saved_servers(window.settings) == []  # a damaged entry is skipped, not fatal
        window.server_button.click()  # Disconnect: methods again
        qtbot.waitUntil(lambda: window.model is None, timeout=10_000)
        assert not compare.methods_box.isHidden() and compare.servers_box.isHidden()
        assert compare.table.horizontalHeaderItem(7).text() == "identical to ar"
        assert window.tabs.tabText(window.tabs.indexOf(compare)) == "Compare methods"
    finally:
        proxy.close()


def test_the_launch_command_follows_the_method_chosen_and_the_engines_version(qtbot, tmp_path, monkeypatch):
    """The dialog writes what ``specdeck launch`` writes, for the engine generation chosen, and says
    why when that engine or version cannot run the method."""
    from PySide6.QtGui import QGuiApplication

    from desktop.launch import LaunchDialog
    from desktop.server import ConnectDialog

    connect = ConnectDialog()
    qtbot.addWidget(connect)
    connect.launch_button.click()
    dialog = connect.launch_dialog
    assert isinstance(dialog, LaunchDialog) and "name the model" in dialog.command.toPlainText()
    assert not dialog.copy_button.isEnabled()
    dialog.model.setText("meta-llama/Llama-3.1-8B-Instruct")
    dialog.method.setCurrentText("pld")
    assert '--speculative-config \'{"method": "ngram"' in dialog.command.toPlainText()
    dialog.version.setText("0.7.3")  # the older flags
    assert "--ngram-prompt-lookup-max" in dialog.command.toPlainText()
    dialog.method.setCurrentText("eagle3")
    assert "needs the draft model" in dialog.command.toPlainText() and not dialog.copy_button.isEnabled()
    dialog.draft.setText("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")
    assert "from version 0.8.5 on" in dialog.command.toPlainText() and not dialog.copy_button.isEnabled()
    dialog.version.setText("0.10.1")
    dialog.gpus.setValue(2)
    text = dialog.command.toPlainText()
    assert '"method": "eagle3"' in text and "--tensor-parallel-size 2" in text and "export VLLM_API_KEY" in text
    dialog.copy_button.click()
    assert QGuiApplication.clipboard().text() == text
    dialog.engine.setCurrentIndex(dialog.engine.findData("llama-server"))
    assert dialog.method.currentText() == "eagle3" and dialog.port.value() == 8080
    dialog.model.setText("big.gguf")
    dialog.draft.setText("eagle3.gguf")
    assert "--spec-draft-model eagle3.gguf --spec-type draft-eagle3" in dialog.command.toPlainText()
    dialog.spelling.setCurrentIndex(dialog.spelling.findData("older"))
    assert "cannot run eagle3" in dialog.command.toPlainText()
    dialog.method.setCurrentText("draft")
    assert "--model-draft eagle3.gguf --draft-max 5" in dialog.command.toPlainText()
    # this PC's llama-server (a stand-in on PATH printing the newer help), read once, off the GUI thread
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "llama-server"
    fake.write_text("#!/bin/sh\necho '--spec-draft-model FNAME  draft model'\necho '--spec-draft-n-max N'\n"
                    "echo '--spec-type {none,draft-simple,draft-eagle3,ngram-simple}  kind'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    dialog.spelling.setCurrentIndex(dialog.spelling.findData("here"))
    qtbot.waitUntil(lambda: "--spec-draft-model eagle3.gguf --spec-type draft-simple" in dialog.command.toPlainText(),
                    timeout=10_000)
    dialog.method.setCurrentText("mtp")  # that build's --spec-type has no draft-mtp
    assert "cannot run mtp" in dialog.command.toPlainText()
