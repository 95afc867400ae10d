"""Chat completion responses: messages, chunks, and what the model's output
holds besides text: its tool calls (tool_use.py) and its reasoning
(reasoning.py), whole or streamed as OpenAI and vLLM stream them."""

from __future__ import annotations

from typing import Callable

from deepserve.gateway.http.reasoning import ReasoningStream, split
from deepserve.gateway.http.responses import (Choice, LogprobEntry, Renderer, Usage,
                                              logprob_value, prompt_logprobs_body,
                                              text_offsets)
from deepserve.messages.engine import RequestDelta


class ChatRenderer(Renderer):
    """tools: the request's ToolPlan (tool_use.py), None without tools: the
    output is read into tool_calls, whole or as streamed deltas. reasoning:
    the model thinks in <think> tags (reasoning.py): that part is
    reasoning_content (left out with include_reasoning false).
    on_tool_calls(index): that choice ended in whole tool calls (its caller
    comes back with their results: control/je/turn_pins.py)."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args, tools=None, with_prompt_logprobs: bool = False,
                 reasoning: bool = False, include_reasoning: bool = True,
                 on_tool_calls: Callable[[int], None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_tool_calls = on_tool_calls
        self.tools, self.with_prompt_logprobs = tools, with_prompt_logprobs
        self.reasoning, self.include_reasoning = reasoning, include_reasoning
        self._streamers: dict[int, object] = {}  # choice index -> its tool-call stream
        self._thinking: dict[int, ReasoningStream] = {}  # choice index -> its reasoning split

    def response(self, choices: list[Choice], usage: Usage) -> dict:
        body = super().response(choices, usage)
        if self.with_prompt_logprobs and choices:  # vLLM: one list, for the one prompt
            body["prompt_logprobs"] = prompt_logprobs_body(choices[0].prompt_entries,
                                                           choices[0].token_bytes)
        return body

    def delta_chunks(self, index: int, delta: RequestDelta) -> list[dict]:
        if self.tools is None and not self.reasoning:
            return super().delta_chunks(index, delta)
        payloads = self._payloads(index, delta)
        logprobs = None
        if self.with_logprobs and delta.logprobs:
            start = self._num_chars.get(index, 0)
            logprobs = self._logprobs(delta.logprobs, text_offsets(delta, start),
                                      delta.token_bytes)
            payloads = payloads or [{"delta": {}}]
        self._num_chars[index] = self._num_chars.get(index, 0) + len(delta.text)
        chunks = [self._chunk(index, p, logprobs if i == 0 else None, None)
                  for i, p in enumerate(payloads)]
        if delta.finish_reason is not None:
            reason = delta.finish_reason
            if self.tools is not None:
                reason = self._finish(index, reason, self._streamers[index].num_calls)
            chunks.append(self._chunk(index, {"delta": {}}, None, reason))
        return chunks

    def _payloads(self, index: int, delta: RequestDelta) -> list[dict]:
        """The deltas one RequestDelta's text becomes: reasoning, then content
        or tool calls."""
        payloads, text, ends = [], delta.text, delta.finish_reason is not None
        if self.reasoning:
            split_stream = self._thinking.setdefault(index, ReasoningStream())
            thought, text = split_stream.feed(text)
            if ends:
                more_thought, more_text = split_stream.finish()
                thought, text = thought + more_thought, text + more_text
            if thought and self.include_reasoning:
                payloads.append({"delta": {"reasoning_content": thought}})
        if self.tools is None:
            return payloads + ([{"delta": {"content": text}}] if text else [])
        streamer = self._streamers.setdefault(index, self.tools.streamer())
        events = streamer.feed(text) + (streamer.finish() if ends else [])
        return payloads + [{"delta": {"content": e}} if isinstance(e, str)
                           else {"delta": {"tool_calls": [e]}} for e in events if e != ""]

    def opening_chunks(self, num_choices: int) -> list[dict]:
        return [self._chunk(i, {"delta": {"role": "assistant", "content": ""}}, None, None)
                for i in range(num_choices)]

    def _text_delta(self, text: str | None) -> dict:
        return {"delta": {} if text is None else {"content": text}}

    def _final_choice(self, choice: Choice) -> dict:
        message = {"role": "assistant", "content": "".join(choice.text)}
        finish_reason = choice.finish_reason
        if self.reasoning:
            thought, message["content"] = split(message["content"])
            if self.include_reasoning:
                message["reasoning_content"] = thought
        if self.tools is not None:
            content, calls = self.tools.final(message["content"])
            message.update(content=content, tool_calls=calls)
            finish_reason = self._finish(choice.index, finish_reason, len(calls))
        return {"index": choice.index, "message": message,
                "logprobs": self._logprobs(choice.logprobs, choice.offsets, choice.token_bytes),
                "finish_reason": finish_reason}

    def _finish(self, index: int, generated: str | None, num_calls: int) -> str | None:
        """The choice's finish_reason; a reply that ended in calls is told."""
        if generated == "stop" and num_calls and self.on_tool_calls is not None:
            self.on_tool_calls(index)
        return self.tools.finish_reason(generated, num_calls)

    def _logprobs(self, entries: list[LogprobEntry], offsets: list[int],
                  token_bytes: dict[int, bytes] | None) -> dict | None:
        if not self.with_logprobs:
            return None
        return {"content": [
            {**self._entry(token_id, logprob, token_bytes),
             "top_logprobs": [self._entry(t, lp, token_bytes) for t, lp in top]}
            for token_id, logprob, top in entries]}

    def _entry(self, token_id: int, logprob: float, token_bytes: dict[int, bytes] | None) -> dict:
        text, raw = self._token(token_id, token_bytes)
        return {"token": text, "logprob": logprob_value(logprob), "bytes": raw}
