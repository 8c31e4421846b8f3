"""The client's header parser gives nats-py's result for every header block."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client

from shared.nats_headers import NatsClient

nats_py_parse = getattr(Client, "_parse_header_lines", None)
pytestmark = pytest.mark.skipif(nats_py_parse is None,
                                reason="this nats-py parses headers as email")

# Lines made of the bytes that matter to a parser: separators, whitespace, non-ASCII.
_pieces = st.sampled_from([b"traceparent", b"Nats-Msg-Id", b":", b": ", b" ", b"\t", b"\r\n",
                           b"\xc3\xa9", b"\xff", b"00-ab-cd-01", b"a b", b"\x0b", b"\x1c", b""])
_blocks = st.lists(_pieces, max_size=24).map(b"".join)


@given(_blocks)
def test_any_header_block_parses_as_nats_py_parses_it(raw: bytes) -> None:
    assert NatsClient._parse_header_lines(raw) == nats_py_parse(raw)


def test_a_traced_message_s_headers() -> None:
    context = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    raw = f"Nats-Msg-Id: r-1\r\ntraceparent: {context}\r\n\r\n".encode()
    assert NatsClient._parse_header_lines(raw) == {"Nats-Msg-Id": "r-1", "traceparent": context}
