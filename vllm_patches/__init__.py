"""vllm-patches: fixes for vLLM's KV-cache path, kept as overlays and shipped as git patches."""
