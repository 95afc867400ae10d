"""GGUF files (llama.cpp's and Ollama's format) imported once into Hugging
Face model directories, cached by content, so every other part of the
platform (TEs, the weight cache, forks, pods) sees one format.

Read with the `gguf` package only (gguf.GGUFReader, gguf.quants.dequantize):

    importer.py   import_gguf(path, cache_root) -> directory; the cache, the built-in model
    convert.py    one file -> config.json, tokenizer files, bf16 safetensors
    blocks.py     Q8_0 / Q4_0 / Q4_1 / Q4_K tensors kept quantized (quantize = "gguf")
    hf_config.py  <arch>.* metadata -> config.json; the architectures read
    tensors.py    tensor names, types, dequantization, llama's Q/K row order
    vocab.py      tokenizer.ggml.* -> tokenizer.json, tokenizer_config.json
    __main__.py   `python -m deepserve.model.gguf FILE` (the node imports through it)
"""

from deepserve.model.gguf.importer import (builtin_gguf, default_cache_root, import_gguf,
                                           import_gguf_to, resolve_model)

__all__ = ["builtin_gguf", "default_cache_root", "import_gguf", "import_gguf_to",
           "resolve_model"]
