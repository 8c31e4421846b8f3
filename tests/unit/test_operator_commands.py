"""`halfmoon workers`' table, from heartbeats."""

from __future__ import annotations

from typing import Any

from services.operator_commands import workers_table
from shared.messages import WorkerHeartbeat


def heartbeat(worker_id: str, **changes: Any) -> WorkerHeartbeat:
    fields: dict[str, Any] = {
        "worker_id": worker_id, "role": "decode", "model": "alpha", "host": "h1",
        "num_running": 3, "num_waiting": 1, "max_batch_size": 8, "num_free_blocks": 75,
        "num_total_blocks": 100, "block_size": 16, "heartbeat_interval_s": 0.5,
        "sent_at_s": 99.5, "home_role": "decode", **changes}
    return WorkerHeartbeat(**fields)


def test_each_worker_is_a_row_with_its_load_and_state() -> None:
    table = workers_table([
        heartbeat("decode-1"),
        heartbeat("decode-2", role="prefill"),
        heartbeat("decode-3", is_draining=True, loading_model="beta", loading_role="prefill"),
        heartbeat("decode-4", is_draining=True)], now_s=100.0)
    header, *rows = table.splitlines()
    assert header.split() == ["WORKER", "ROLE", "MODEL", "HOST", "RUNNING", "WAITING", "KV",
                              "USED", "SEEN", "STATE"]
    assert rows[0].split() == ["decode-1", "decode", "alpha", "h1", "3", "1", "25", "%",
                               "0.5", "s", "ago", "serving"]
    assert rows[1].endswith("serving (home: decode)")
    assert rows[2].endswith("loading beta as prefill")
    assert rows[3].endswith("draining")
    assert len({row.index("alpha") for row in rows}) == 1  # columns line up


def test_no_worker_says_so() -> None:
    assert workers_table([], now_s=0.0).splitlines()[1] == "(no live worker)"
