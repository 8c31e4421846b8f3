from __future__ import annotations

import msgspec

from shared.heartbeats import WorkerDirectory
from tests.unit.test_placement import worker


def test_worker_is_healthy_while_heartbeats_are_fresh() -> None:
    directory = WorkerDirectory(timeout_s=2.0)
    directory.observe(worker("a"), now_s=100.0)
    assert [w.worker_id for w in directory.healthy("prefill", now_s=101.0)] == ["a"]


def test_worker_whose_heartbeats_stop_gets_no_work() -> None:
    directory = WorkerDirectory(timeout_s=2.0)
    directory.observe(worker("a"), now_s=100.0)
    assert directory.healthy("prefill", now_s=102.5) == []
    assert not directory.is_healthy("a", now_s=102.5)


def test_draining_worker_is_not_healthy() -> None:
    directory = WorkerDirectory(timeout_s=2.0)
    directory.observe(msgspec.structs.replace(worker("a"), is_draining=True), now_s=0.0)
    assert directory.healthy("prefill", now_s=0.0) == []


def test_roles_are_kept_apart() -> None:
    directory = WorkerDirectory(timeout_s=2.0)
    directory.observe(worker("p"), now_s=0.0)
    directory.observe(worker("d", "decode"), now_s=0.0)
    assert [w.worker_id for w in directory.healthy("decode", now_s=0.0)] == ["d"]


def test_models_are_kept_apart_when_asked() -> None:
    directory = WorkerDirectory(timeout_s=2.0)
    directory.observe(worker("m-worker"), now_s=0.0)  # serves model "m"
    directory.observe(msgspec.structs.replace(worker("other"), model="other"), now_s=0.0)
    assert [w.worker_id for w in directory.healthy("prefill", now_s=0.0, model="m")] == [
        "m-worker"]
    assert len(directory.healthy("prefill", now_s=0.0)) == 2


def test_a_reader_whose_own_loop_stalled_excuses_the_silence() -> None:
    directory = WorkerDirectory(timeout_s=2.0)
    directory.observe(worker("a"), now_s=100.0)
    assert directory.is_lost("a", now_s=105.0)
    directory.excuse_silence(now_s=105.0)  # it read nothing from 100 to 105
    assert not directory.is_lost("a", now_s=106.5)
    assert directory.is_lost("a", now_s=107.5)  # a whole timeout to be heard again


def test_excusing_silence_while_disconnected_leaves_it_to_the_reconnection() -> None:
    directory = WorkerDirectory(timeout_s=2.0)
    directory.observe(worker("a"), now_s=100.0)
    directory.suspend(now_s=101.0)
    directory.excuse_silence(now_s=105.0)
    assert not directory.is_lost("a", now_s=110.0)  # judged as of 101: still suspended
    directory.resume(now_s=110.0)
    assert directory.is_lost("a", now_s=112.5)
