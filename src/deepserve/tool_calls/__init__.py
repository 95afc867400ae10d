"""OpenAI tool calling without a process of its own: what tool_choice forces
(`choice`), the calls found in free text (`parsers`) and in a stream
(`stream`), and tools said in plain messages for chat templates that know
none (`render`). Floor 0: it imports only messages/, errors and the standard
library, so the gateway and the TE's tokenizer can both use it."""
