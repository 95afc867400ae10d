"""One TE (FlowServe engine): scheduler, sequences, tokenizer, the LLM API."""
