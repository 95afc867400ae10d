"""One TE (FlowServe engine): the step core every way of running one shares.

Here: scheduler, sequences, StepCore, detokenizer, output processor. Beside
them: te/ (the TE as processes: master, tokenizer actor, launcher, te_server,
pre-warmed pod, report, client), pd/ (prefill/decode disaggregation, pure
policy), tiers/ (the master's side of the node's KV tiers) and api/ (the
in-process API: LLM, LLMEngine, outputs).
"""
