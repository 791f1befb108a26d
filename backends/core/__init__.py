"""The speculative decoding core: types, token trees, acceptance rules, the engine loop, stats.

Vocabulary (used the same way everywhere in SpecDeck)
------------------------------------------------------
- **target** (p): the model whose output we promise. Its distribution after the usual sampling
  processing (repetition penalty, top-k, top-p, min-p, temperature) is ``p``.
- **draft** (q): whatever proposes tokens cheaply: another model, a lookup in the prompt, a head.
  ``q`` is the distribution a drafted token was drawn from; a deterministic drafter has a
  one-hot ``q``.
- **root**: the last emitted token, not yet in the target's KV cache. Every verify batch starts
  with it, so the target's logits at the root give the distribution of the first draft position.
- **proposal**: a token tree hanging under the root (a chain is the simple case), with parent
  indices (``-1`` means "child of the root").
- **accepted** token: a drafted token the acceptance rule keeps. **rejected**: the first drafted
  token on the path that it refuses; everything below it is discarded.
- **bonus** token: the token the target itself emits after the last accepted one (sampled from
  ``p``, or from the residual ``norm(max(0, p - q))`` after a rejection). Every verify step emits
  exactly one bonus token, so a step emits ``accepted + 1`` tokens.
- **tau** (acceptance length): tokens emitted per target forward, bonus included (plain decoding
  has tau = 1).
- **acceptance rate**: accepted / drafted.

Worked example: root ``the``, proposal chain ``cat sat on``; the target agrees with ``cat`` and
``sat`` but wants ``down`` where the draft said ``on``. Verdict: accepted ``cat sat``, bonus
``down``; the step emits 3 tokens for one forward (tau contribution 3), drafted 3, accepted 2.
"""
