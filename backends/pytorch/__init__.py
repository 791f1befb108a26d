"""The PyTorch backend: SpecDeck's own small transformer (``model``), its shapes (``shape``), weights
from a Hugging Face folder or a GGUF (``weights``), and the target the engine verifies with
(``target``). torch is optional: nothing here is imported unless a session asks for this backend."""
