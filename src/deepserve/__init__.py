"""DeepServe: a serverless LLM serving platform (FlowServe engines, RTC, DistFlow)."""

from deepserve.engine.llm import LLM
from deepserve.engine.outputs import RequestOutput
from deepserve.errors import (DeepServeError, InvalidRequestError, ModelLoadError,
                              PromptTooLongError, UnsupportedModelError)
from deepserve.messages.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "DeepServeError", "InvalidRequestError",
           "ModelLoadError", "PromptTooLongError", "UnsupportedModelError"]
