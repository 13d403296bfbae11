"""The persistent lane and its backends (one contract: :mod:`.contract`).

Each backend registers itself in its own file (:data:`.contract.PERSISTENT_BACKENDS`, which imports those
files on its first lookup: importing this package stays free of torch). The app config's
``persistent_backend`` choices, the CLI's and :func:`.factory.create_backend`'s come from that registry.
"""


def __getattr__(name: str):
    if name == "BACKENDS":
        from replicas.persistent.contract import PERSISTENT_BACKENDS

        return ("auto", *PERSISTENT_BACKENDS.names())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


BACKENDS: tuple[str, ...]
"""``auto`` (``cuda_graph`` on a CUDA GPU when the model has a static decode step, else ``eager``),
``eager`` (the reference, any device), ``cuda_graph`` (NVIDIA), ``mk1`` (AMD aiter MK1 on MI355X; only
when named): ``auto`` then the registry's names, read when asked for."""
