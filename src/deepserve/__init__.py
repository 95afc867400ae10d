"""DeepServe: a serverless LLM serving platform (FlowServe engines, RTC, DistFlow).

The public names load lazily (PEP 562), so a process that needs only the
plumbing (ipc, messages) does not pay for importing torch.
"""

from importlib import import_module

_EXPORTS = {
    "LLM": "deepserve.engine.api.llm",
    "RequestOutput": "deepserve.engine.api.outputs",
    "SamplingParams": "deepserve.messages.sampling",
    "DeepServeError": "deepserve.errors",
    "EngineDeadError": "deepserve.errors",
    "InvalidRequestError": "deepserve.errors",
    "ModelLoadError": "deepserve.errors",
    "PromptTooLongError": "deepserve.errors",
    "UnsupportedModelError": "deepserve.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'deepserve' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
