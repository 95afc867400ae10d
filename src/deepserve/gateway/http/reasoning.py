"""reasoning_content: the thinking a model writes in <think> ... </think>
at the start of its output (Qwen3, QwQ), split from its answer, as vLLM's
Qwen3 reasoning parser does. The parser is chosen per model from its chat
template: one that writes or names "<think>" gets it; others have no
reasoning to split.

    "<think>plan</think>answer"  ->  reasoning "plan", content "answer"
    "<think>still thinking"      ->  reasoning only (cut short by max_tokens)
    "answer"                     ->  content only (thinking off)

A template that opens the think block in the prompt itself (DeepSeek-R1's:
the output starts inside it) is not split: its output is content.

Streaming: text before the end tag goes out as reasoning_content deltas,
text after it as content (the tool-call reader sees only the content); a
tail that may be the start of a tag is held until the next text settles it.
include_reasoning=false (vLLM's field) drops the reasoning.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def has_reasoning(chat_template: str | None) -> bool:
    return bool(chat_template) and START in chat_template


def split(text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output."""
    if not text.startswith(START):
        return None, text
    reasoning, _, content = text[len(START):].partition(END)
    return reasoning.strip("\n") or None, content.lstrip("\n")


class ReasoningStream:
    """One streamed choice: feed() -> (reasoning piece, content piece)."""

    def __init__(self):
        self._buffer = ""
        self._state = "start"  # start: nothing decided; thinking; answering
        self._after_end = False  # newlines right after </think> are not content

    def feed(self, text: str) -> tuple[str, str]:
        if self._state == "answering":
            return "", self._content(text)
        self._buffer += text
        if self._state == "start":
            if START.startswith(self._buffer) and len(self._buffer) < len(START):
                return "", ""  # maybe the start tag
            if not self._buffer.startswith(START):
                self._state, rest, self._buffer = "answering", self._buffer, ""
                return "", rest
            self._buffer = self._buffer[len(START):].lstrip("\n")
            self._state = "thinking"
        return self._thinking()

    def finish(self) -> tuple[str, str]:
        """Whatever was held back: a partial tag is text after all."""
        rest, self._buffer = self._buffer, ""
        if self._state == "thinking":
            return rest, ""
        return "", rest  # answering, or a start that never became the tag

    def _thinking(self) -> tuple[str, str]:
        if END in self._buffer:
            reasoning, _, content = self._buffer.partition(END)
            self._buffer, self._state, self._after_end = "", "answering", True
            return reasoning.rstrip("\n"), self._content(content)
        keep = _partial_tail(self._buffer, END)
        out, self._buffer = self._buffer[:len(self._buffer) - keep], \
            self._buffer[len(self._buffer) - keep:]
        return out, ""


    def _content(self, text: str) -> str:
        if self._after_end:
            text = text.lstrip("\n")
            self._after_end = not text
        return text


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of text that begins tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
