"""raas.pipeline: the rollout service (``service``) and its parts: wiring of the layers (``wiring``), the
job table (``table``), admission (``admission``), the stage scheduler (``scheduler``), the budget clock
(``clock``), results (``results``), endings (``endings``), the durable ledger (``ledger``), the
configuration (``config``) and the event bus (``events``)."""
