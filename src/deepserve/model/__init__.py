"""Llama / Qwen2-family decoder in pure torch: no sockets, no scheduler."""
