"""The decoder of every supported family (Llama, Qwen2/3, Mistral, Phi-3, Gemma 3,
Qwen3-MoE, Mixtral) in pure torch, its loader and GGUF importer: no sockets,
no scheduler."""
