"""Every engine implements every role protocol; a prefix cache may be a composed part."""

from __future__ import annotations

import pytest

from engine.block_ledger import BlockLedger
from engine.fake_engine import FakeEngine
from engine.protocol import DecodeEngine, Engine, KvPool, PrefillEngine, PrefixCache
from engine.sim_engine import SimEngine
from engine.torch_engine import TorchEngine


def members(protocol: type) -> set[str]:
    return {name for klass in protocol.__mro__ if klass not in (object,)
            and getattr(klass, "_is_protocol", False)
            for name in vars(klass) if not name.startswith("_")}


@pytest.mark.parametrize("engine", [FakeEngine, SimEngine, TorchEngine])
@pytest.mark.parametrize("protocol", [PrefillEngine, DecodeEngine, KvPool, Engine])
def test_each_engine_implements_each_role(engine: type, protocol: type) -> None:
    assert members(protocol) and members(protocol) <= set(dir(engine))


@pytest.mark.parametrize("cache", [BlockLedger, TorchEngine])
def test_each_prefix_cache_implements_the_protocol(cache: type) -> None:
    assert members(PrefixCache) <= set(dir(cache))


def test_every_protocol_member_says_what_it_does() -> None:
    for protocol in (PrefillEngine, DecodeEngine, PrefixCache, KvPool, Engine):
        assert protocol.__doc__
        for name in vars(protocol):
            member = getattr(protocol, name)
            if callable(member) and not name.startswith("_") and name != "eos_token_ids":
                assert member.__doc__, f"{protocol.__name__}.{name}"
