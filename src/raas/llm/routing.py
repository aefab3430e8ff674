"""How the balancer picks a server for a trajectory's first request, and where GRPO groups live.

The samples of one GRPO group share their prompt. Sent to one server, that prompt is prefilled once and
every later sample of the group is served from the server's prefix cache; spread over all servers, each
server prefills it again. ``group`` routing therefore gives each group a *home* server and sends the
group's new trajectories there while the home's load allows; a trajectory's later turns always go to the
server its earlier turns used (their prefix is cached there), whatever the mode.

Homes are forgotten: a group whose trajectories have all been released becomes *idle*, and only the
``idle_groups`` most recently used idle groups are remembered (so a straggler of a finished group still
finds the cache its group left), so the bookkeeping is bounded by the live trajectories plus that cap.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

RoutingMode = Literal["group", "trajectory", "round_robin"]


class RoutingConfig(BaseModel):
    """The balancer's routing policy.

    * ``group`` (default): a new trajectory goes to its group's home while the home has fewer than
      ``max(group_slack, group_load_factor x least in-flight)`` requests in flight (least over the healthy
      servers), else to the least-loaded server (the trajectory *spills*; the home stays). A group without
      a usable home (new, its home removed or unhealthy) gets the least-loaded server as its home.
    * ``trajectory``: a new trajectory goes to the least-loaded server (ties rotate); groups are ignored.
    * ``round_robin``: every request goes to the next healthy server in turn, with no pinning at all (a
      baseline: later turns lose their prefix cache).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: RoutingMode = "group"
    group_slack: int = Field(
        8, ge=0, description="A group's home always takes a new trajectory while it has fewer in flight"
    )
    group_load_factor: float = Field(
        2.0, ge=1.0, description="...or while it has fewer than this times the least-loaded server's"
    )
    idle_groups: int = Field(
        1024, ge=0, description="Finished groups whose home is still remembered (most recently used)"
    )

    def home_has_room(self, home_in_flight: int, least_in_flight: int) -> bool:
        return home_in_flight < max(self.group_slack, self.group_load_factor * least_in_flight)


@dataclass
class _Group:
    address: str | None
    members: set[str] = field(default_factory=set)


class GroupHomes:
    """Group -> home server, for live groups (with member trajectories) and a bounded LRU of idle ones."""

    def __init__(self, idle_limit: int) -> None:
        self.idle_limit = idle_limit
        self._live: dict[str, _Group] = {}
        self._idle: OrderedDict[str, str] = OrderedDict()
        self._group_of: dict[str, str] = {}  # trajectory -> group

    def home(self, group: str, *, touch: bool = True) -> str | None:
        live = self._live.get(group)
        if live is not None:
            return live.address
        address = self._idle.get(group)
        if address is not None and touch:
            self._idle.move_to_end(group)
        return address

    def set_home(self, group: str, address: str) -> None:
        live = self._live.get(group)
        if live is not None:
            live.address = address
            return
        self._idle[group] = address
        self._idle.move_to_end(group)
        self._trim()

    def join(self, group: str, trajectory_id: str) -> None:
        """The trajectory belongs to the group: the group stays live until the trajectory is released."""
        current = self._group_of.get(trajectory_id)
        if current == group:
            return
        if current is not None:
            self.leave(trajectory_id)
        live = self._live.get(group)
        if live is None:
            live = self._live[group] = _Group(self._idle.pop(group, None))
        live.members.add(trajectory_id)
        self._group_of[trajectory_id] = group

    def leave(self, trajectory_id: str) -> None:
        group = self._group_of.pop(trajectory_id, None)
        if group is None:
            return
        live = self._live[group]
        live.members.discard(trajectory_id)
        if live.members:
            return
        del self._live[group]
        if live.address is not None:
            self._idle[group] = live.address
            self._trim()

    def forget_address(self, address: str) -> None:
        """The server is gone: its groups get a new home on their next request."""
        for live in self._live.values():
            if live.address == address:
                live.address = None
        for group in [g for g, a in self._idle.items() if a == address]:
            del self._idle[group]

    def clear(self) -> None:
        for live in self._live.values():
            live.address = None
        self._idle.clear()

    def live_on(self, address: str) -> int:
        return sum(1 for g in self._live.values() if g.address == address)

    def counts(self) -> dict[str, int]:
        return {"live": len(self._live), "idle": len(self._idle), "trajectories": len(self._group_of)}

    def _trim(self) -> None:
        while len(self._idle) > self.idle_limit:
            self._idle.popitem(last=False)
