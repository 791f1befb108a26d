"""Add-ons: optional Python packages SpecDeck installs into the user's data folder on request.

torch is the one today. It is 0.9 GB installed (the CPU build) to 3 GB (with CUDA) and only training heads
and the PyTorch backend need it, so the installers leave it out. A user who asks for either gets
it installed here, by pip, into ``<data dir>/addons/cp311-linux-x86_64`` (one folder per Python
version and platform, since the wheels are binary): the frozen app carries pip and runs it as
``specdeck -m pip``; a source install uses its own interpreter. ``activate`` appends that folder
to ``sys.path`` (after everything bundled, so an add-on can never replace a part of SpecDeck),
and the app and every child process it starts call it at start-up.

Which build of torch: with an NVIDIA GPU the default index (CUDA wheels); otherwise PyTorch's CPU
index, which is a tenth of the download. ``SPECDECK_ADDON_PIP_ARGS`` adds pip options (a local
wheel folder with ``--find-links``, a mirror), which is how tests and offline machines use it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import shlex
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from backends.core.errors import SpecDeckError
from backends.models.paths import data_dir

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@dataclass(frozen=True)
class AddOn:
    name: str  # the import name
    requirement: str  # what pip installs
    needed_for: str  # in the user's words
    size: str  # the download, roughly, for the question the window asks
    cpu_index: str | None = None  # a smaller CPU-only build's index, used where no NVIDIA GPU is found


ADDONS = {
    "torch": AddOn("torch", "torch==2.13.0", "training draft heads and the PyTorch backend",
                   "the CPU build is a 200 MB download and 0.9 GB installed; with CUDA (on a PC with an "
                   "NVIDIA GPU) about 3 GB", cpu_index=CPU_INDEX),
}


def addon_dir() -> Path:
    """Where add-ons go: per Python version and platform (binary wheels fit one of each)."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}-{sysconfig.get_platform().replace('.', '_')}"
    return data_dir() / "addons" / tag


def frozen() -> bool:
    """Running from the installers' frozen app (PyInstaller), not from a Python environment."""
    return bool(getattr(sys, "frozen", False))


def activate() -> None:
    """Make installed add-ons importable in this process (appended: bundled modules come first)."""
    folder = str(addon_dir())
    if os.path.isdir(folder) and folder not in sys.path:
        sys.path.append(folder)
        importlib.invalidate_caches()


def available(name: str) -> bool:
    activate()
    return importlib.util.find_spec(name) is not None


def require(name: str, purpose: str):
    """Import an add-on or stop with what to do, in the words that fit how SpecDeck was installed."""
    activate()
    try:
        return importlib.import_module(name)
    except ImportError:
        pass
    if frozen():
        how = (f"install the {name} add-on: in the window, pick \"PyTorch (install ...)\" under Run with in the "
               f"Models dock, or run `specdeck-gui -m backends.addons install {name}`")
    else:
        how = f"pip install 'specdeck[{name}]' (or `python -m backends.addons install {name}`)"
    raise SpecDeckError(f"{purpose} needs {name}, which is not installed: {how}")


def install_command(name: str, *, nvidia_gpu: bool) -> list[str]:
    """The pip command that installs an add-on into ``addon_dir()`` (run it in a child process)."""
    addon = ADDONS[name]
    command = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
               "--upgrade", "--target", str(addon_dir()), addon.requirement]
    if addon.cpu_index and not nvidia_gpu:
        command += ["--index-url", addon.cpu_index, "--extra-index-url", "https://pypi.org/simple"]
    return command + shlex.split(os.environ.get("SPECDECK_ADDON_PIP_ARGS", ""))


def has_nvidia(gpus) -> bool:
    """Whether CUDA wheels are worth their size here: an NVIDIA card among ``gpus`` (GpuInfo)."""
    return any(gpu.vendor == "nvidia" for gpu in gpus)


def _nvidia_gpu() -> bool:
    from backends.hardware.gpus import detect_gpus

    return has_nvidia(detect_gpus()[0])


def main(argv: list[str] | None = None) -> int:
    """``python -m backends.addons install NAME`` / ``list``: what the window runs, for a terminal."""
    import argparse
    import subprocess

    parser = argparse.ArgumentParser(prog="specdeck addons", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    install = sub.add_parser("install", help="install an add-on into SpecDeck's data folder")
    install.add_argument("name", choices=sorted(ADDONS))
    sub.add_parser("list", help="the add-ons and whether they are installed")
    args = parser.parse_args(argv)
    if args.command == "list":
        for addon in ADDONS.values():
            state = "installed" if available(addon.name) else "not installed"
            print(f"{addon.name}: {state} · for {addon.needed_for} · {addon.size} · {addon_dir()}")
        return 0
    command = install_command(args.name, nvidia_gpu=_nvidia_gpu())
    print(f"installing {args.name} into {addon_dir()} ({platform.machine()})", flush=True)
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
