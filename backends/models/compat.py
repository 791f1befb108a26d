"""Can this model draft for that one? Only if they speak the same tokens.

Speculative decoding hands token ids from the draft to the target unchanged, so the two
vocabularies must agree: same tokenizer type, same BOS/EOS ids and add-BOS/EOS flags, sizes within
128 (padding rows differ between conversions), and the same text for every token from id 5 on
(the first ids are special tokens that conversions renumber harmlessly). The rules follow
llama.cpp's own draft compatibility check.

Example: Gemma-3 (SentencePiece, 262144 tokens) for SmolLM2 (BPE, 49152 tokens) gives the reasons
"tokenizer type differs (llama vs gpt2)", "vocabulary sizes differ by 212992 (limit 128)", ...
"""

from __future__ import annotations

from backends.models.gguf_info import VocabInfo

MAX_VOCAB_SIZE_DIFFERENCE = 128
FIRST_CHECKED_TOKEN = 5


def draft_incompatibility(target: VocabInfo, draft: VocabInfo) -> list[str]:
    """Every reason ``draft`` cannot draft for ``target``; empty when it can."""
    reasons = []
    if target.kind != draft.kind:
        reasons.append(f"tokenizer type differs ({draft.kind} vs {target.kind})")
    if (target.bos, target.eos) != (draft.bos, draft.eos):
        reasons.append(f"BOS/EOS ids differ ({draft.bos}/{draft.eos} vs {target.bos}/{target.eos})")
    if (target.add_bos, target.add_eos) != (draft.add_bos, draft.add_eos):
        reasons.append("add-BOS/add-EOS flags differ")
    size_gap = abs(target.n_vocab - draft.n_vocab)
    if size_gap > MAX_VOCAB_SIZE_DIFFERENCE:
        reasons.append(f"vocabulary sizes differ by {size_gap} ({draft.n_vocab} vs {target.n_vocab}; limit {MAX_VOCAB_SIZE_DIFFERENCE})")
    shared = min(len(target.tokens), len(draft.tokens))
    for token_id in range(FIRST_CHECKED_TOKEN, shared):
        if target.tokens[token_id] != draft.tokens[token_id]:
            reasons.append(
                f"token {token_id} differs ({draft.tokens[token_id]!r} vs {target.tokens[token_id]!r})"
            )
            break
    return reasons
