"""raas.pipeline: job records (``jobs``), the durable ledger (``ledger``), the three-stage rollout service
(``service``), its configuration (``config``), the event bus (``events``) and metrics (``metrics``).

Kept free of imports on purpose: any layer may import ``raas.pipeline.metrics`` without pulling in the
service.
"""
