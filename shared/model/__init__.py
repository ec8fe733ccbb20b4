"""Llama-family model code and its Hugging Face checkpoint loader."""

from shared.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelConfigError
from shared.model.llama import LlamaForCausalLM
from shared.model.loader import load_model

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaForCausalLM", "ModelConfig", "ModelConfigError", "load_model"]
