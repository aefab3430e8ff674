"""raas on many nodes: one raas service per Ray node and a router in front of them.

* :mod:`raas.cluster.ray_nodes`: the Ray side (imports ``ray``; the ``raas[cluster]`` extra). Places one
  node service per selected Ray node as a named, detached actor pinned to that node, and lists them.
* :mod:`raas.cluster.router`: the front door. The same native ``/v1`` and ProRL-compatible API as one
  service (``raas.api`` serves it through :class:`raas.api.protocol.Served`), with its own durable ledger;
  it assigns each job to the least-loaded healthy node, follows results over SSE and moves a lost node's
  unfinished jobs to the others.
* :mod:`raas.cluster.nodes`: what the router knows about a node and how it talks to it (HTTP only).
"""
