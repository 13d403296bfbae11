"""The kernel tests' one setting: Triton's CPU interpreter on a machine without a GPU.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a kernel, i.e. when a kernel module is first
imported, so it is set here, when pytest loads this conftest, before it imports any test module of this
folder (and so before they import the kernels). On a CUDA machine (``make test-gpu``) nothing is set and
the same tests run the compiled kernels. ``make test-kernels`` runs this folder on its own; the other
stages (``make test-unit``, ``make test-serve``) never load this file, so they never run the interpreter.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
