"""Put SpecDeck's own CPU kernels into the llama.cpp of a llama-cpp-python source tree.

    python packaging/llama_patch.py SRC      # SRC: the unpacked llama-cpp-python sdist

Why a patch: speculative decoding lives on verifying a few rows as cheaply as one, and llama.cpp's
CPU path for 2-12 rows of F16/BF16 weights costs almost a row each on some CPUs (AMD Zen 4:
2 rows 1.6-2.2x one). ``llama_patches/specdeck-smallbatch.h`` says why and what it does instead.
The edit to ``ggml-cpu.c`` is three insertions at lines found by their text: an include, the
kernel's turn in ``ggml_compute_forward_mul_mat`` (after ggml's own tiled K-quant path, before
llamafile's), and its work buffer in ``ggml_graph_plan``. Running it again changes nothing; a
llama.cpp whose code moved fails loudly, naming what it could not find, instead of building
without the kernel.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

HEADER = Path(__file__).resolve().parent / "llama_patches" / "specdeck-smallbatch.h"
CPU_DIR = Path("vendor/llama.cpp/ggml/src/ggml-cpu")

# (anchor, text inserted after it): each anchor must occur exactly once in ggml-cpu.c
INSERTIONS = [
    ('#include "tiled/tiled.h"\n', '#include "specdeck-smallbatch.h"\n'),
    ("""    if (ggml_compute_forward_mul_mat_tiled(params, dst)) {
        return;
    }
""", """
    if (!params->use_ref && specdeck_sb_applies(src0, src1)) {
        specdeck_sb_mul_mat(params, dst);
        return;
    }
"""),
    ("""                            cur = ggml_row_size(vec_dot_type, ggml_nelements(node->src[1]));
                        }
""", """                        if (specdeck_sb_applies(node->src[0], node->src[1])) {
                            cur = MAX(cur, specdeck_sb_wsize(node->src[1]));
                        }
"""),
]


def patch_source(text: str) -> str:
    """``ggml-cpu.c`` with SpecDeck's insertions (unchanged if they are there already)."""
    done = [after in text for _, after in INSERTIONS]
    if all(done):
        return text
    if any(done):
        raise SystemExit("llama_patch: ggml-cpu.c is partly patched already; unpack the sdist again")
    for anchor, after in INSERTIONS:
        count = text.count(anchor)
        if count != 1:
            first = anchor.strip().splitlines()[0]
            raise SystemExit(f"llama_patch: found {count} places for '{first}' in ggml-cpu.c (expected 1): "
                             "this llama.cpp differs from the one the patch was written for")
        text = text.replace(anchor, anchor + after)
    return text


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    cpu = Path(argv[0]) / CPU_DIR
    source = cpu / "ggml-cpu.c"
    if not source.is_file():
        raise SystemExit(f"llama_patch: {source} not found: is {argv[0]} an unpacked llama-cpp-python sdist?")
    shutil.copyfile(HEADER, cpu / HEADER.name)
    text = source.read_text(encoding="utf-8")
    patched = patch_source(text)
    if patched != text:
        source.write_text(patched, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
