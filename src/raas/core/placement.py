"""Node-aware placement of inference servers on raas services.

A rollout's LLM calls are the bulk of its traffic; a raas service on the same node as the inference server
keeps them off the network. :func:`plan_llm_assignment` attaches each inference server to a raas service on
its own host first, then spreads the rest over the services that have the fewest, and finally lets a
service that would otherwise have none share one (it could not run a single rollout without one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

_LOOPBACK = {"localhost", "127.0.0.1", "::1", "0.0.0.0"}


def host_of(url: str) -> str:
    """The host part of an http(s) URL, lower-cased; loopback names all become ``localhost``."""
    host = (urlsplit(url).hostname or url).lower()
    return "localhost" if host in _LOOPBACK else host


def plan_llm_assignment(
    services: Sequence[str],
    llm_servers: Sequence[str],
    *,
    hosts: Mapping[str, str] | None = None,
) -> dict[str, list[str]]:
    """Which inference servers each raas service should use: ``{service_url: [llm_address, ...]}``.

    ``hosts`` maps a service URL or an LLM address to its node name when the URL does not show it (e.g.
    services reached through a load balancer); otherwise the URL's host is the node. Deterministic: the
    same inputs give the same plan."""
    if not services:
        return {}
    hosts = dict(hosts or {})

    def node(url: str) -> str:
        return hosts[url].lower() if url in hosts else host_of(url)

    plan: dict[str, list[str]] = {s: [] for s in services}
    by_node: dict[str, list[str]] = {}
    for s in services:
        by_node.setdefault(node(s), []).append(s)
    rest: list[str] = []
    for address in llm_servers:
        local = by_node.get(node(address))
        if local:
            # Among the services on that node, the one with the fewest servers so far (first on ties).
            target = min(local, key=lambda s: len(plan[s]))
            plan[target].append(address)
        else:
            rest.append(address)
    for address in rest:
        target = min(services, key=lambda s: len(plan[s]))
        plan[target].append(address)
    if llm_servers:
        # A service left without any server shares the least-shared one.
        load = {a: 1 for a in llm_servers}
        for s in services:
            if not plan[s]:
                address = min(llm_servers, key=lambda a: load[a])
                load[address] += 1
                plan[s].append(address)
    return plan
