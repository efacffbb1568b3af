"""One ``vllm serve`` child's life: its states, the supervisor, the child process and what a
crashed run left behind, the client for vLLM's routes, and the plugin's import path."""
