"""Attention over the paged KV cache, behind one small seam (``AttentionBackend``)."""
from leapdecode.attention.backend import AttentionBackend, AttentionMetadata, get_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]
