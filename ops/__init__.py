"""Operating the service.

Two halves that point one way:

- :mod:`ops.telemetry`: tracing, trace sampling, metrics and the engine's telemetry. The serving
  path (``deployments/``, ``replicas/engine_actor.py``) may import it.
- :mod:`ops.tools` (GSM8K evaluation, soak, tiny-model maker, model shapes, persistent-checkpoint tool):
  offline tools an operator runs against a deployment; they import the runtime. Nothing in ``replicas/``
  or ``deployments/`` imports them (``tests/test_layering.py`` checks it). Benchmarks live outside the
  package, in ``benchmarks/`` at the repository root.
"""
