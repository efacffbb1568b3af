"""One ``vllm serve`` child's life: the supervisor (its states are ``rolloutd.wire.states``), the
child process and what a crashed run left behind, and the plugin's import path."""
