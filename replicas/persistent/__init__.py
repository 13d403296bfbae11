"""The persistent lane and its backends (one contract: :mod:`.contract`).

:data:`BACKENDS` is the one list of backend names: the app config's ``persistent_backend`` choices, the
CLI's and :func:`.factory.create_backend`'s come from it.
"""

BACKENDS = ("auto", "eager", "cuda_graph", "mk1")
"""``auto`` (``cuda_graph`` on a CUDA GPU when the model has a static decode step, else ``eager``),
``eager`` (the reference, any device), ``cuda_graph`` (NVIDIA), ``mk1`` (AMD aiter MK1 on MI355X; only
when named)."""
