"""The persistent pool's autoscaling policy: scale on eligible demand, not on requests waiting.

The router sends an eligible request to the standard lane at once when every persistent replica is
busy (``policy.spillover``), so few requests ever wait in Serve's queue for the persistent pool: the
queue length Serve's default policy scales on would stay near zero under any load. Instead each
persistent replica reports a custom autoscaling metric (Serve's ``record_autoscaling_stats``):

``eligible_demand`` = persistent requests running + eligible requests the standard lane is serving
because of persistent capacity (``GenerateRequest.spilled``), summed over the whole application
(``deployments.replicas.eligible_demand``: one snapshot of the load records the engines push to the
application's pool board, read through ``policy.pool.PoolModel.eligible_demand``).

Every replica reports the same application-wide number (read at slightly different times), so the
policy takes the largest of their windowed values, and at least Serve's own count of ongoing and
queued requests (so requests that do wait still count), and asks for
``demand / target_ongoing_requests`` replicas. Serve applies ``upscale_delay_s``,
``downscale_delay_s``, the scaling factors and the replica bounds to that number (Ray >= 2.51:
``ray.serve.config.AutoscalingContext`` and custom policies). The module must stay importable on its
own: Serve pickles the policy by value into its controller.
"""

from __future__ import annotations

ELIGIBLE_DEMAND = "eligible_demand"
"""Name of the custom autoscaling metric the persistent replicas report."""

POLICY_PATH = "deployments.autoscaling:eligible_demand_policy"
"""Import path of :func:`eligible_demand_policy` (``autoscaling_config.policy.policy_function``)."""


def eligible_demand_policy(ctx) -> tuple[float, dict]:
    """Desired persistent replicas for ``ctx`` (a ``ray.serve.config.AutoscalingContext``).

    Returns:
        ``(max(eligible demand, Serve's ongoing requests) / target_ongoing_requests, {})``; before any
        replica runs, Serve's own target (its cold-start path scales a pool at zero on queued requests).
    """
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    metrics = ctx.aggregated_metrics or {}
    reported = metrics.get(ELIGIBLE_DEMAND) or {}
    demand = max([float(v) for v in reported.values()] + [float(ctx.total_num_requests or 0.0)])
    target = ctx.config.target_ongoing_requests if ctx.config is not None else None
    return demand / (target or 1.0), {}
