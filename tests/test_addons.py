"""Add-ons (backends/addons.py): torch installed on request into SpecDeck's data folder, for the
installers' frozen app, which leaves it out. The install itself runs for real in the frozen app's
smoke test (packaging/smoke.sh: `specdeck -m backends.addons install torch`, then a chat on the
PyTorch backend); here: the folder, the command, the import order, the message and the window's
offer."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from backends import addons  # noqa: E402
from backends.core.errors import SpecDeckError  # noqa: E402


@pytest.fixture
def data(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECK_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("SPECDECK_ADDON_PIP_ARGS", raising=False)
    saved = list(sys.path)
    yield tmp_path / "data"
    sys.path[:] = saved


def test_the_command_installs_into_the_data_folder_with_the_cpu_build_unless_an_nvidia_gpu_is_there(data, monkeypatch):
    cpu = addons.install_command("torch", nvidia_gpu=False)
    assert cpu[:4] == [sys.executable, "-m", "pip", "install"]
    target = cpu[cpu.index("--target") + 1]
    assert target == str(addons.addon_dir()) and target.startswith(str(data / "addons" / f"cp{sys.version_info.major}"))
    assert "torch==2.13.0" in cpu and cpu[cpu.index("--index-url") + 1] == addons.CPU_INDEX
    assert "--index-url" not in addons.install_command("torch", nvidia_gpu=True)  # CUDA wheels: the default index
    monkeypatch.setenv("SPECDECK_ADDON_PIP_ARGS", "--find-links '/srv/my wheels' --no-index")
    assert addons.install_command("torch", nvidia_gpu=True)[-3:] == ["--find-links", "/srv/my wheels", "--no-index"]


def test_an_installed_addon_imports_but_never_shadows_what_is_bundled(data):
    folder = addons.addon_dir()
    (folder / "specdeck_probe_addon").mkdir(parents=True)
    (folder / "specdeck_probe_addon" / "__init__.py").write_text("WHERE = 'add-on folder'\n")
    (folder / "backends").mkdir()
    (folder / "backends" / "__init__.py").write_text("raise RuntimeError('an add-on replaced SpecDeck')\n")
    assert str(folder) not in sys.path
    assert addons.available("specdeck_probe_addon")  # activates the folder
    import specdeck_probe_addon

    assert specdeck_probe_addon.WHERE == "add-on folder"
    assert sys.path.index(str(folder)) == len(sys.path) - 1  # after everything SpecDeck ships
    import backends.addons as again  # still SpecDeck's own package

    assert again is addons


def test_a_missing_addon_says_what_to_install_and_how(data):
    with pytest.raises(SpecDeckError) as caught:
        addons.require("specdeck_not_an_addon", "the PyTorch backend")
    text = str(caught.value)
    assert "the PyTorch backend needs specdeck_not_an_addon, which is not installed" in text
    assert "python -m backends.addons install" in text  # a source install: pip or the add-on command


def test_picking_pytorch_without_torch_offers_the_addon_and_keeps_llama_cpp(qtbot, data, monkeypatch):
    from desktop import library

    monkeypatch.setattr(library, "torch_installed", lambda: False)
    models = library.ModelLibrary([])
    qtbot.addWidget(models)
    torch_row = models.backend.findData("torch")
    assert "install" in models.backend.itemText(torch_row)
    models.backend.setCurrentIndex(torch_row)
    assert models.backend.currentData() == "llamacpp"  # until torch is there
    dialog = models.addon
    assert dialog is not None and dialog.isVisible()
    about = " ".join(label.text() for label in dialog.findChildren(type(dialog.status)))
    assert "training draft heads and the PyTorch backend" in about and str(addons.addon_dir()) in about
    dialog.cancel_button.click()
    qtbot.waitUntil(lambda: models.addon is None, timeout=2000)
    models._torch_arrived("torch")  # what a finished install signals
    assert models.backend.currentData() == "torch" and models.backend.itemText(torch_row) == "PyTorch"
