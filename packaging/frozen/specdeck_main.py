"""The frozen app's entry point (PyInstaller runs this as ``specdeck``).

SpecDeck starts child processes of itself: the llama.cpp CPU probe, the memory check and
training run as ``sys.executable -m MODULE ...``. In a frozen app ``sys.executable`` is this
program, not a Python, so ``-m MODULE`` is handled here the way Python would handle it; with no
``-m`` the window starts (``--self-test`` included). ``-m pip`` is how add-ons are installed
(pip is bundled for that).
"""

from __future__ import annotations

import multiprocessing
import runpy
import sys


def main() -> int:
    multiprocessing.freeze_support()
    from backends.addons import activate

    activate()  # torch, when the user installed it as an add-on (backends/addons.py)
    if len(sys.argv) > 2 and sys.argv[1] == "-m":
        module = sys.argv[2]
        sys.argv = [sys.argv[0], *sys.argv[3:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    from desktop.app import main as app_main

    return app_main()


if __name__ == "__main__":
    sys.exit(main())
