"""RUN for a rollout whose agent runs outside raas (see :mod:`raas.gateway.external`): the gateway session
replaces the handler's agent, and the handler completes the record with what the agent sent at close, so
EVAL grades it exactly as it grades the handler's own rollouts."""

from __future__ import annotations

from dataclasses import asdict

from raas.core.trajectory import RunOutput
from raas.errors import RaasError
from raas.pipeline.table import ActiveJob
from raas.pipeline.wiring import Layers


def is_external(a: ActiveJob, layers: Layers) -> bool:
    """True for a job opened as an external rollout (``POST /v1/gateway/rollouts``)."""
    return layers.gateway is not None and layers.gateway.external.get(a.job_id) is not None


async def run_external(a: ActiveJob, layers: Layers) -> RunOutput:
    assert a.env is not None and layers.gateway is not None
    llm = layers.llm_context(a.job)
    rollout = layers.gateway.external.get(a.job_id)
    if rollout is not None:
        a.acknowledge = rollout.recorded  # the close is answered once its record is committed
    lease = f" ({rollout.lease_s:g} s)" if rollout is not None else ""
    session, closing = await layers.gateway.external.serve(a.job, llm.agent)
    if session.infra_error is not None:  # as for a harness job: what the agent did next is not the policy's
        err = session.infra_error
        raise RaasError(
            f"the gateway could not serve the agent ({err.kind}): {err.message}", kind=err.kind, stage="run"
        )
    if closing is None:
        raise RaasError(
            f"the external rollout was abandoned: no request and no close within its lease{lease}",
            kind="cancelled",
            stage="run",
        )
    out = session.run_output(session.finish_reason or "agent_exit")
    out.artifacts["external"] = {"closed": True, "metadata": closing.metadata}
    return a.handler.external_output(a.job, a.env, out, asdict(closing))
