"""raas.core: the records every layer shares, so imports only point down.

* :mod:`raas.core.jobs`: what a trainer submits and receives (``JobRequest``, ``JobResult``, ``JobInfo``,
  ``JobEvent``, statuses, ids) and the handler's view of a job (``Job``);
* :mod:`raas.core.trajectory`: the token-exact result schema (``Message``, ``Turn``, ``TokenTrajectory``,
  ``RunOutput``, ``EvalOutput``);
* :mod:`raas.core.policy`: per-handler stage policy (``StagePolicy``, ``StageTimeouts``);
* :mod:`raas.core.metrics`: the Prometheus registry ``/metrics`` serves, and the metric objects.

It imports nothing from raas but :mod:`raas.errors`; any layer may import it.
"""
