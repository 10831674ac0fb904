"""raystream on a multi-node Ray cluster with Ray's TLS on (`make test-cluster`): every node,
driver and `serve deploy` with RAY_USE_TLS and certificates of a CA made here. The stage calls
between the nodes go over the replicas' ports inside TLS with Ray's certificates: a tap on
loopback reads neither the photos nor their labels (test_cluster.py's same tap reads both
without TLS)."""

from __future__ import annotations

import pytest
from loopback_cluster import LoopbackCluster, Tap, deploy_raystream, in_private_network
from loopback_cluster import start_three_nodes as start_nodes
from test_cluster import STAGE_PORTS, _classify, _port_calls, seen_in_clear

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(
        not in_private_network(),
        reason="needs a network namespace of its own with only loopback: `make test-cluster`",
    ),
]


@pytest.fixture(scope="module")
def tls_cluster():
    with LoopbackCluster(tls=True) as cluster:
        start_nodes(cluster)
        yield cluster


async def test_with_rays_tls_a_tap_on_the_stage_ports_reads_nothing_in_clear(
    tls_cluster, model_repository, photos
) -> None:
    deployed = deploy_raystream(tls_cluster, model_repository)
    answers = await _classify(deployed, photos, 4)  # the callers read the addresses meanwhile
    assert len(answers) == 4
    with Tap(STAGE_PORTS) as tap:
        answers = await _classify(deployed, photos, 4)
    assert [len(answer.results) for answer in answers] == [2] * 4
    assert all(_port_calls(tls_cluster, name) for name in ("Preprocess", "Inference"))
    assert tap.packets > 0  # the calls went over the stage ports...
    assert not seen_in_clear(tap, photos["chelsea"])  # ...and nothing of them in clear
