"""The KV cache's page size: one constant that the kernels, the KV cache and the engine config share.

Its own module without torch, so that :mod:`replicas.config` (imported by every Serve replica process,
the ingress and the lane wrappers included) does not load torch for it.
"""

PAGE_SIZE = 16
"""Tokens per KV page (docs/design.md "KV cache geometry"; vLLM's default block size)."""
