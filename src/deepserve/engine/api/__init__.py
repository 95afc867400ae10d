"""The in-process API: LLM (vLLM's shape), LLMEngine (one TE's step loop in
one process) and what a request hands back (outputs)."""
