"""OpenAI-compatible servers (vLLM, llama-server, llama-cpp-python's) as a backend.

A server drafts and verifies by itself; SpecDeck streams its answers as engine events
(``session``), reads its speculative-decoding counters (``metrics``), writes the command that
starts it with a method (``launch``), keeps its API key (``keys``), benches servers side by side
(``bench``) and serves the bundled model itself (``serve``). ``client`` turns every way a server
or network fails into a message.
"""
