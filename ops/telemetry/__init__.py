"""Runtime telemetry that the serving path imports: OpenTelemetry tracing (:mod:`.tracing`,
:mod:`.trace_sampling`), Ray metrics (:mod:`.metrics`) and the engine actor's hooks
(:mod:`.engine_telemetry`). It imports nothing from ``ops.tools`` or ``benchmarks``."""
