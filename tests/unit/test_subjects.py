from __future__ import annotations

import pytest

from shared.errors import ConfigError
from shared.subjects import Subjects


def test_subjects_live_under_the_cluster_and_schema_version() -> None:
    subjects = Subjects("prod")
    assert subjects.requests == "halfmoon.prod.v1.requests"
    assert subjects.gateway("gw-1") == "halfmoon.prod.v1.gateway.gw-1"
    assert subjects.prefill_task("p1") == "halfmoon.prod.v1.worker.p1.prefill"
    assert subjects.decode_reserve("d1") == "halfmoon.prod.v1.worker.d1.reserve"
    assert subjects.kv_target("p1") == "halfmoon.prod.v1.worker.p1.kv_target"
    assert subjects.kv_commit("d1") == "halfmoon.prod.v1.worker.d1.kv_commit"
    assert subjects.heartbeat("decode", "d1") == "halfmoon.prod.v1.heartbeat.decode.d1"
    assert subjects.all_heartbeats == "halfmoon.prod.v1.heartbeat.>"
    assert subjects.abort == "halfmoon.prod.v1.abort"
    assert subjects.kv_events("p1") == "halfmoon.prod.v1.kv_events.p1"
    assert subjects.all_kv_events == "halfmoon.prod.v1.kv_events.>"


def test_stream_and_bucket_names_are_valid_jetstream_names() -> None:
    subjects = Subjects("team-a")
    assert subjects.requests_stream == "HALFMOON_TEAM_A_REQUESTS"
    assert subjects.workers_bucket == "halfmoon_team_a_workers"


def test_two_clusters_never_share_a_subject() -> None:
    a, b = Subjects("a"), Subjects("b")
    assert a.requests != b.requests
    assert a.requests_stream != b.requests_stream


@pytest.mark.parametrize("bad", ["", "a.b", "x*", "y>", "with space"])
def test_ids_that_would_break_a_subject_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="must match"):
        Subjects("ok").gateway(bad)
