"""rolloutd's vLLM plugin: the weight-transfer engine that loads a version from the node mirror.

It runs inside ``vllm serve`` (API server, engine core and workers); the daemon never imports it.
"""
