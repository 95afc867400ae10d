"""Typed exceptions every layer raises; the gateway maps them to HTTP codes.

    DeepServeError
    ├── InvalidRequestError (also ValueError)   bad prompt or sampling field
    │   ├── PromptTooLongError                  prompt + room to generate > max_model_len
    │   └── ContextNotFoundError                no such context (for this tenant)
    ├── ModelLoadError                          model directory unusable
    │   └── UnsupportedModelError               architecture we do not implement
    └── EngineDeadError                         a TE process died; its requests fail
"""


class DeepServeError(Exception):
    """Base of every error DeepServe raises on purpose."""


class InvalidRequestError(DeepServeError, ValueError):
    """A request is malformed; raised before it enters the batch.

    `param` names the offending field (OpenAI's error body has the same slot);
    `code` is the RequestFailed.error it travels as.
    """

    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class SpecError(InvalidRequestError):
    """A grammar, schema or tool choice that is well-formed JSON but cannot
    be served: it does not compile, is past a bound, or names a tool the
    request does not give. No JSON schema of the request can say so, so it
    has a code of its own (HTTP 400, code "invalid_spec")."""

    code = "invalid_spec"


class PromptTooLongError(InvalidRequestError):
    """The prompt does not fit the model's context (`max_model_len`)."""

    code = "prompt_too_long"


class ContextNotFoundError(InvalidRequestError):
    """A context id that does not exist for the caller (expired, deleted, another tenant's)."""

    code = "context_not_found"


class ModelLoadError(DeepServeError):
    """The model directory is missing, incomplete or corrupt."""


class UnsupportedModelError(ModelLoadError):
    """config.json names an architecture we do not implement."""


class EngineDeadError(DeepServeError):
    """A process of the TE died or the TE was shut down: in-flight requests fail."""
