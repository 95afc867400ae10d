"""Tokens at the gateway: POST /tokenize and /detokenize (vLLM's shapes), and
each model's max_model_len (also shown on /v1/models).

    POST /tokenize   {model?, prompt, add_special_tokens = true, return_token_strs = false}
                   | {model?, messages, add_generation_prompt = true,
                      add_special_tokens = false, return_token_strs = false}
                 ──> {count, max_model_len, tokens: [id], token_strs: [str] | null}
    POST /detokenize {model?, tokens: [id]} ──> {prompt}

No model: the first served one. The gateway tokenizes itself, with a
deepserve.tokenizer.Tokenizer per served model loaded (in a thread, on first
use) from the model's directory, which the node's config names
(GatewayConfig.model_dirs). Tokenizing is a pure function of the model's
files, and the head that runs the gateway has them (its job executor loads
the same directories to route): a request/reply to the JE or a TE would add
message types, a code path there and a failure mode (a JE restarting, a
model scaled to zero) for nothing.

The ids are those a generation request's prompt gets in the TE: a prompt
encoded as a completion prompt is (BOS as tokenizer_config.json says),
messages rendered by the chat template with special-token text in their
content encoded as text. add_special_tokens with messages adds what the
tokenizer's post-processor puts around one text (e.g. a BOS), on top of the
template's, as vLLM does. token_strs are the vocabulary's strings (vLLM's
convert_ids_to_tokens). /detokenize decodes special tokens too (vLLM's
decode) and refuses an id past both the tokenizer's and the model's
vocabulary (400). Text is bounded by [gateway] max_prompt_chars as on
generation requests; encoding runs in a thread, off the event loop.

max_model_len: the smallest that a listed TE of the model announces
(TEInfo.max_model_len, the limit its engine enforces); while none is listed
(scaled to zero, starting) the model's max_position_embeddings
(config.json), the most any TE of it could take; null if neither is known.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from deepserve.errors import ModelLoadError
from deepserve.gateway.config import GatewayConfig
from deepserve.gateway.errors import APIError
from deepserve.gateway.http.auth import state_of, tenant_of
from deepserve.gateway.http.schemas import MAX_NUM_MESSAGES, MAX_TOKEN_ID, ChatMessage, Int
from deepserve.messages.control import TEInfo
from deepserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
router = APIRouter()

_EXACTLY_ONE_INPUT = {"oneOf": [
    {"required": ["messages"], "not": {"required": ["prompt"]}},
    {"required": ["prompt"], "not": {"required": ["messages"]}}]}


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one body:
    exactly one of prompt and messages."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_EXACTLY_ONE_INPUT)
    model: str = None
    prompt: str = None
    messages: Annotated[list[ChatMessage], Field(min_length=1,
                                                 max_length=MAX_NUM_MESSAGES)] = None
    add_special_tokens: bool = None
    """Default: true for a prompt, false for messages (the template writes them)."""
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str = None
    tokens: list[Int(ge=0, le=MAX_TOKEN_ID)]


@router.post("/tokenize", response_model=None, dependencies=[Depends(tenant_of)])
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    state, tokens = state_of(request), tokens_of(request)
    model = _model(body.model, state.config)
    if (body.messages is None) == (body.prompt is None):
        raise APIError.bad_request("give exactly one of messages and prompt", "messages")
    messages = None
    if body.messages is not None:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        num_chars, field = sum(len(m["content"]) for m in messages), "messages"
    else:
        num_chars, field = len(body.prompt), "prompt"
    if num_chars > state.config.max_prompt_chars:
        raise APIError.prompt_too_long(f"{field} has {num_chars} characters; at most "
                                       f"{state.config.max_prompt_chars} are accepted", field)
    tokenizer = await tokens.tokenizer(model)
    special = body.add_special_tokens
    if messages is None:
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt, special is not False)
    else:
        ids = await asyncio.to_thread(_chat_ids, tokenizer, messages,
                                      body.add_generation_prompt, bool(special))
    strs = [tokenizer.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
    max_len = tokens.max_model_len(model, state.client.cluster.tes)
    return {"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize", response_model=None, dependencies=[Depends(tenant_of)])
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    state, tokens = state_of(request), tokens_of(request)
    model = _model(body.model, state.config)
    if len(body.tokens) > state.config.max_prompt_chars:
        raise APIError.prompt_too_long(f"tokens has {len(body.tokens)} ids; at most "
                                       f"{state.config.max_prompt_chars} are accepted", "tokens")
    tokenizer = await tokens.tokenizer(model)
    max_id = max(tokenizer.vocab_size, _positive(tokens.model_config(model).get("vocab_size"))) - 1
    bad = next((i for i in body.tokens if i > max_id), None)
    if bad is not None:
        raise APIError.bad_request(f"Token id {bad} is out of vocabulary", "tokens")
    text = await asyncio.to_thread(tokenizer.decode, body.tokens, False)
    return {"prompt": text}


def tokens_of(request: Request) -> "ModelTokens":
    return request.app.state.tokens


def _model(name: str | None, config: GatewayConfig) -> str:
    if name is None:
        return config.served_model
    if name not in config.served_models:
        raise APIError.model_not_found(name)
    return name


def _chat_ids(tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool,
              add_special_tokens: bool) -> list[int]:
    """The ids of chat messages, as a chat request's prompt gets them."""
    if add_generation_prompt:
        _, ids = tokenizer.request_ids(messages=messages)
    else:
        ids = tokenizer.encode_rendered(*tokenizer.render(messages, add_generation_prompt=False))
    if not add_special_tokens:
        return ids
    head, tail = _special_ends(tokenizer)
    return [*head, *ids, *tail]


def _special_ends(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """The ids encode() puts before and after one text (a BOS, an EOS)."""
    bare, full = tokenizer.encode("a", False), tokenizer.encode("a", True)
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return full[:i], full[i + len(bare):]
    return [], []


class ModelTokens:
    """Each served model's tokenizer (loaded once, on first use) and the
    numbers of its config.json."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self._tokenizers: dict[str, Tokenizer] = {}
        self._configs: dict[str, dict] = {}
        self._lock = threading.Lock()  # loads run in threads

    async def tokenizer(self, model: str) -> Tokenizer:
        found = self._tokenizers.get(model)
        if found is not None:
            return found
        if model not in self.config.model_dirs:
            raise APIError.bad_request(f"The model {model!r} cannot be tokenized by this "
                                       "server.", "model")
        return await asyncio.to_thread(self._load, model)

    def _load(self, model: str) -> Tokenizer:
        with self._lock:
            if model not in self._tokenizers:
                try:
                    self._tokenizers[model] = Tokenizer(self.config.model_dirs[model])
                except ModelLoadError as e:
                    logger.error("tokenizer of %r cannot be loaded: %s", model, e)
                    raise APIError(500, "The model's tokenizer could not be loaded.",
                                   "server_error", None, "tokenizer_unavailable") from e
            return self._tokenizers[model]

    def model_config(self, model: str) -> dict:
        """The model's config.json ({} when it is not known or unreadable)."""
        if model not in self._configs:
            directory = self.config.model_dirs.get(model)
            try:
                found = json.loads((Path(directory) / "config.json").read_text()) \
                    if directory else {}
            except (OSError, ValueError):
                found = {}
            self._configs[model] = found if isinstance(found, dict) else {}
        return self._configs[model]

    def max_model_len(self, model: str, tes: list[TEInfo]) -> int | None:
        """Tokens of one sequence at most (module doc)."""
        one_model = len(self.config.served_models) == 1  # its TEs may carry any name
        lens = [te.max_model_len for te in tes
                if te.max_model_len > 0 and (one_model or te.model == model)]
        if lens:
            return min(lens)
        return _positive(self.model_config(model).get("max_position_embeddings")) or None


def _positive(value) -> int:
    """A config.json number that is a positive int, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
