"""A StructuredOutput as xgrammar's grammar: checked (no vocabulary needed)
and compiled against a model's vocabulary (cached by spec).

    json            the schema; an object takes no property the schema does
                    not name unless it says so (additionalProperties), as
                    vLLM (xgrammar's strict mode) and OpenAI's strict mode
    json_object     any JSON object
    regex           the pattern (xgrammar's regex dialect: no lookaround,
                    no backreferences)
    choice          exactly one of the strings
    grammar         EBNF (xgrammar's / GBNF's, root rule `root`)
    structural_tag  xgrammar's structural tag: {"type": "structural_tag",
                    "format": ...}, or vLLM's older {"structures": [{"begin",
                    "schema", "end"}], "triggers": [...]}

JSON output allows whitespace between tokens but never a run longer than
MAX_WHITESPACE (a small model left free to emit whitespace can emit it
forever); `disable_any_whitespace` makes it compact.

The vocabulary comes from the model's tokenizer.json through the
`tokenizers` library (no transformers tokenizer object): its token strings,
and the vocabulary type (byte-level, byte fallback, raw) that xgrammar
detects from the same file. The grammar's stop tokens are the model's EOS
ids: a finished grammar allows only them.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import threading
from functools import lru_cache
from pathlib import Path
from typing import Callable, TypeVar

from deepserve.errors import SpecError
from deepserve.messages.sampling import StructuredOutput
from deepserve.structured.limits import PARAM, check_limits

MAX_WHITESPACE = 8
"""Whitespace characters in a row at most, inside JSON output."""
BEAT_S = 0.25
"""How often while_beating beats while the grammar engine starts."""
T = TypeVar("T")


def while_beating(work: Callable[[], T], beat: Callable[[], None] | None) -> T:
    """work() on a thread while this one calls beat() every BEAT_S: the first
    grammar of a process imports xgrammar (torch, transformers) and reads the
    vocabulary, seconds that a process judged by its heartbeat must not spend
    silent (a loaded machine took more than a TE's 10 s deadline). The
    caller's thread only waits meanwhile, so nothing competes for the cores."""
    if beat is None:
        return work()
    result: list = []

    def run() -> None:
        try:
            result.append((True, work()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            result.append((False, e))

    thread = threading.Thread(target=run, name="grammar-start", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(BEAT_S)
        beat()
    ok, value = result[0]
    if not ok:
        raise value
    return value


def ensure_loaded(beat: Callable[[], None] | None = None) -> None:
    """xgrammar imported (once per process), beating while it loads."""
    if "xgrammar" not in sys.modules:
        while_beating(lambda: importlib.import_module("xgrammar"), beat)


def check(structured: StructuredOutput, param: str = PARAM) -> None:
    """SpecError(param) unless it is within bounds and compiles."""
    check_limits(structured, param)
    try:
        grammar_of(structured)
    except SpecError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own
        raise SpecError(f"the {structured.kind} spec does not compile: "
                                  f"{_first_line(e)}", param) from e


def grammar_of(structured: StructuredOutput):
    """xgrammar.Grammar of a StructuredOutput (raises on a bad spec)."""
    import xgrammar as xgr
    kind, spec = structured.kind, structured.spec
    if kind == "json":
        return xgr.Grammar.from_json_schema(spec, **_json_options(structured))
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', **_json_options(structured))
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "choice":
        alternatives = " | ".join(_ebnf_string(c) for c in json.loads(spec))
        return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec)
    if kind == "structural_tag":
        return _structural_tag(json.loads(spec))
    raise SpecError(f"unknown structured output kind {kind!r}", PARAM)


def _json_options(structured: StructuredOutput) -> dict:
    if structured.compact:
        return {"any_whitespace": False}
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE}


def _structural_tag(value):
    import xgrammar as xgr
    if isinstance(value, dict) and "structures" in value:  # vLLM's older form
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})),
                                       end=s["end"]) for s in value["structures"]]
        return xgr.Grammar.from_structural_tag(items, list(value.get("triggers", [])))
    return xgr.Grammar.from_structural_tag(json.dumps(value))


def _ebnf_string(text: str) -> str:
    """A string literal of xgrammar's EBNF: JSON's escapes."""
    return json.dumps(text, ensure_ascii=True)


_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[14:49:15] /x/y.cc:94: "


def _first_line(e: Exception) -> str:
    """xgrammar's message, without the C++ source location it starts with."""
    text = str(e).strip() or type(e).__name__
    return _SOURCE_PREFIX.sub("", text.splitlines()[0])[:300]


class GrammarCompiler:
    """Compiles StructuredOutputs against one model's vocabulary; xgrammar
    caches compiled grammars by spec (CACHE_BYTES of them at most)."""

    CACHE_BYTES = 256 * 2**20

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: list[int],
                 max_threads: int = 1):
        import xgrammar as xgr
        self.info = tokenizer_info(str(model_dir), vocab_size, tuple(eos_token_ids))
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads,
                                             cache_limit_bytes=self.CACHE_BYTES)

    def compile(self, structured: StructuredOutput):
        return self._compiler.compile_grammar(grammar_of(structured))


@lru_cache(maxsize=4)
def tokenizer_info(model_dir: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """xgrammar's TokenizerInfo of a model directory's tokenizer.json: every
    id below vocab_size (the model's, padding included) with its token string."""
    import xgrammar as xgr
    from tokenizers import Tokenizer
    path = Path(model_dir) / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    encoded = [""] * vocab_size
    for token, idx in tok.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size:
            encoded[idx] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(path.read_text())
    return xgr.TokenizerInfo(encoded, vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=list(eos_token_ids),
                             add_prefix_space=meta["add_prefix_space"])
