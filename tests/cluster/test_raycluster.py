"""The test cluster itself: a node that cannot start ends the start with that node's own output."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from tests.cluster.raycluster import ClusterStartError, LocalRayCluster

pytestmark = [pytest.mark.integration, pytest.mark.ray_cluster]


def test_a_head_that_cannot_start_is_reported_with_its_output() -> None:
    """``ray start`` refusing its arguments (here a negative resource) is seen as soon as it exits, and the
    error carries what it printed: no driver left waiting on a GCS that will never come."""
    c = LocalRayCluster([-1])
    with pytest.raises(ClusterStartError) as err:
        c.start(timeout_s=200, attempts=1)
    report = str(err.value)
    assert report.startswith("`ray start` of node 127.0.") and "exited with status 1 (attempt 1)" in report
    assert "Resource quantities must be nonnegative" in report
    assert not c.tagged_pids() and not c.dir.exists()
