"""Each server's public listener: the only way to a vLLM server from other hosts."""
