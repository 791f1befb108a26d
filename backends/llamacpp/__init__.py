"""The llama.cpp backend: a GGUF model and the target that verifies token trees in one decode."""
