"""GGUF (llama.cpp) models: a reader of its own, numpy dequantisation, the metadata's tokenizer.

    model = edgetrain.load_model("model.gguf")       # routes to load_gguf: a LlamaModel (llama, qwen2)
    model = edgetrain.load_model("model.gguf", backend="mlx")  # an MLXDecoder, Q4/Q8 weights kept packed
    tokenizer = model_tokenizer(model)                # edgetrain.data.tokenizer: the file's BPE vocabulary
    tokenizer = load_gguf_tokenizer("model.gguf")     # the same, without reading any tensor
"""
from edgetrain.models.gguf.config import config_from_metadata
from edgetrain.models.gguf.dequant import dequantize
from edgetrain.models.gguf.loader import load_gguf, load_packed_gguf
from edgetrain.models.gguf.reader import GGUFError, GGUFFile, TensorInfo, read_gguf
from edgetrain.models.gguf.tokenizer import GGUFTokenizer, load_gguf_tokenizer

__all__ = ["GGUFError", "GGUFFile", "GGUFTokenizer", "TensorInfo", "config_from_metadata", "dequantize",
           "load_gguf", "load_gguf_tokenizer", "load_packed_gguf", "read_gguf"]
