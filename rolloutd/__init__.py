"""rolloutd: keeps a node's vLLM servers on the newest policy weights a trainer published."""

__version__ = "0.1.0"
