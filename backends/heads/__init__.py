"""Trained draft heads: small networks that read the target's own hidden states and guess ahead.

A head is trained by SpecDeck for one model (``specdeck train``), from that model's own answers
(self-distillation), and stored as safetensors plus a JSON config naming the model it was made
for (``files.HeadFile``). Running a head needs only numpy (``medusa.MedusaHeads``); training it
needs torch (``train``), an optional extra. Nothing here imports a backend: the hidden states
come through the ``Target`` protocol (``HIDDEN_STATES``), the output layer's weights from the
model file.
"""
