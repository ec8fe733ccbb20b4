"""Fused kernels of the decode loop and their torch reference twins.

The engine calls kernels only through the names exported here, so the CUDA versions (CuPy
RawModule, compiled with NVRTC) replace the references in one place when a GPU is present.
"""

from kernels.attention_ref import AttentionMetadata, append_attention_ref, write_kv_ref

append_attention = append_attention_ref
write_kv = write_kv_ref

__all__ = ["AttentionMetadata", "append_attention", "write_kv"]
