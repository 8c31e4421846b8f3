"""The storm (`bench/storm.py`): faults one after another under every kind of request, each
output equal to the fault-free run's. The storm itself runs with `-m chaos`."""

from __future__ import annotations

import pytest

from bench.storm import KINDS, main, make_requests, malformed, parse_args


@pytest.mark.chaos
def test_a_storm_of_faults_changes_no_output() -> None:
    assert main(["--requests", "36", "--every-s", "4",
                 "--faults", "kill-decode,restart-nats,pause-prefill,kill-conductor"]) == 0


def test_the_storm_sends_the_same_requests_of_every_kind_each_run() -> None:
    requests = make_requests(2 * len(KINDS))
    assert requests == make_requests(2 * len(KINDS))
    paths = {path for path, _ in requests}
    assert paths == {"/v1/completions", "/v1/chat/completions", "/v1/responses"}
    with pytest.raises(SystemExit):
        parse_args(["--faults", "kill-gateway"])  # its own clients may fail: not a storm's


def test_a_structured_output_or_call_that_does_not_parse_is_a_problem() -> None:
    (_, schema), (_, tools) = make_requests(6)[2], make_requests(6)[5]
    path = "/v1/chat/completions"

    def result(text: str | None, calls: list[tuple[str, str]], finish: str) -> list[object]:
        return [[text, calls, finish, []]]

    assert malformed(path, schema, 200, result('{"name": "a", "age": 3}', [], "stop")) is None
    assert malformed(path, schema, 200, result('{"name": "a"', [], "stop"))
    assert malformed(path, schema, 200, result('{"name": "a"', [], "length")) is None
    call = ("get_weather", '{"city": "Oslo"}')
    assert malformed(path, tools, 200, result(None, [call], "tool_calls")) is None
    assert malformed(path, tools, 200, result(None, [("get_weather", '{"ci')], "tool_calls"))
    assert malformed(path, tools, 200, result("no call", [], "stop"))
