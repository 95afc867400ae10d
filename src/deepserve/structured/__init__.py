"""Structured outputs: grammars the output must follow (JSON schema, regex,
choice, EBNF, structural tags), through xgrammar, the grammar engine vLLM and
SGLang use. `limits` checks a StructuredOutput without xgrammar (the gateway's
400s); `compile` turns one into xgrammar's grammar (the TE's tokenizer checks
that it compiles; the worker compiles it against the vocabulary); `matchers`
keeps each sequence's grammar state in the worker and masks a batch's logits.

xgrammar is imported only when a request asks for a grammar: it pulls torch
and transformers in (seconds), which a TE that never sees one never pays."""
