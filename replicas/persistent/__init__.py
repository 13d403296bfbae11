"""The persistent lane and its backends (one contract: :mod:`.contract`).

Each backend registers itself in its own file (:data:`.contract.PERSISTENT_BACKENDS`); importing this
package imports them, so the registry is complete. The app config's ``persistent_backend`` choices, the
CLI's and :func:`.factory.create_backend`'s come from that registry.
"""

# isort: off
# Each module registers its backend; this order is the registry's (and the choices') order.
from replicas.persistent import eager  # noqa: F401
from replicas.persistent import cuda_graph  # noqa: F401
from replicas.persistent import mk1  # noqa: F401
# isort: on
from replicas.persistent.contract import PERSISTENT_BACKENDS

BACKENDS = ("auto", *PERSISTENT_BACKENDS.names())
"""``auto`` (``cuda_graph`` on a CUDA GPU when the model has a static decode step, else ``eager``),
``eager`` (the reference, any device), ``cuda_graph`` (NVIDIA), ``mk1`` (AMD aiter MK1 on MI355X; only
when named): a snapshot of the registry taken at import (``auto`` first)."""
