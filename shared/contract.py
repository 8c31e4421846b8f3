"""The published NATS contract, generated from the code: a JSON Schema per message (from
the msgspec structs in `shared/messages.py`) and an AsyncAPI 3 document mapping every subject
(from `shared/subjects.py`) to its messages.

`halfmoon schema --out DIR` writes them (`DIR/schemas/<Message>.json`, `DIR/asyncapi.json`);
the copy under `docs/contract/` is checked by a test to be current, so the documents never
drift from what the services send.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec

from shared import messages
from shared.messages import Message
from shared.subjects import SCHEMA_VERSION, Subjects

# Subject tokens that stand for AsyncAPI channel parameters.
_PARAMETERS = {
    "CLUSTERTOKEN": ("cluster", "the cluster name (`--cluster`)"),
    "WORKERTOKEN": ("worker_id", "a worker's id"),
    "GATEWAYTOKEN": ("gateway_id", "a gateway's id"),
    "ROLETOKEN": ("role", "prefill | decode"),
    "KINDTOKEN": ("kind", "accepted | placed | first_token | kv_committed | finished | "
                          "failed | migrated"),
    "ACTIONTOKEN": ("action", "granted | released | expired"),
}


@dataclass(frozen=True)
class Channel:
    """One subject (pattern) of the contract, the messages on it, and how they travel."""

    key: str
    address: str
    messages: tuple[type[Message], ...]
    summary: str
    delivery: Literal["core", "jetstream", "request"]
    is_public: bool = False
    reply: type[Message] | tuple[type[Message], ...] | None = None

    @property
    def replies(self) -> tuple[type[Message], ...]:
        """The answers to a request: one per message sent, in the same order."""
        if self.reply is None:
            return ()
        return self.reply if isinstance(self.reply, tuple) else (self.reply,)


def channels() -> list[Channel]:
    s = Subjects("CLUSTERTOKEN")
    worker, gateway = "WORKERTOKEN", "GATEWAYTOKEN"
    m = messages
    return [
        Channel("requestEvents", s.request_event("KINDTOKEN"), (m.RequestEvent,),
                "Request lifecycle events for anyone on the bus (no prompt or output text).",
                "core", is_public=True),
        Channel("kvLeaseEvents", s.kv_lease_event("ACTIONTOKEN"), (m.KvLeaseEvent,),
                "KV blocks held on behalf of another party: granted, released, expired.",
                "core", is_public=True),
        Channel("kvEvents", s.kv_events(worker), (m.KvEventBatch,),
                "Prefix-cache changes of one worker (replayable JetStream stream "
                f"{s.kv_events_stream}).", "jetstream", is_public=True),
        Channel("heartbeats", s.heartbeat("ROLETOKEN", worker), (m.WorkerHeartbeat,),
                "Each worker's load and capacity, every heartbeat interval.", "core",
                is_public=True),
        Channel("requests", s.requests, (m.GenerateRequest,),
                f"The work queue (JetStream stream {s.requests_stream}); the gateway "
                "publishes, conductors consume.", "jetstream"),
        Channel("gateway", s.gateway(gateway),
                (m.TokenBatch, m.RequestFailed, m.RequestPlaced),
                "Tokens, failures and placements for one gateway's requests.", "core"),
        Channel("gatewayStatus", s.gateway_status(gateway),
                (m.StreamQuery, m.OpenStreamsQuery),
                "To a request's gateway: from a conductor before placing a request "
                "delivered again (is it placed, streaming, still wanted?); from a decode "
                "worker every few seconds (which of these does a client still wait for?).",
                "request", reply=(m.StreamStatus, m.OpenStreams)),
        Channel("abort", s.abort, (m.AbortRequest,),
                "Stop a request and free its blocks (every worker listens); one its gateway "
                "ended is not placed (the conductors listen too).", "core"),
        Channel("prefillTask", s.prefill_task(worker), (m.PrefillTask,),
                "Conductor to prefill worker.", "request", reply=m.DispatchReply),
        Channel("decodeReserve", s.decode_reserve(worker), (m.DecodeReservation,),
                "Conductor to decode worker.", "request", reply=m.DispatchReply),
        Channel("kvTarget", s.kv_target(worker), (m.KvTarget,),
                "Decode worker to prefill worker: where the KV goes.", "core"),
        Channel("kvCommit", s.kv_commit(worker), (m.KvCommitted,),
                "Prefill worker to decode worker: the KV is in.", "request",
                reply=m.DispatchReply),
        Channel("prefixFetch", s.prefix_fetch(worker), (m.PrefixFetch,),
                "Prefill worker to prefill worker: send me these cached blocks.", "request",
                reply=m.PrefixFetched),
        Channel("kvLeaseRenewal", s.kv_lease_renewal(worker), (m.KvLeaseRenewal,),
                "Prefill worker to decode worker, every heartbeat: keep these reservations.",
                "core"),
        Channel("streamResume", s.stream_resume(worker), (m.StreamResume,),
                "Gateway to decode worker: send these stalled streams' tokens again.",
                "core"),
        Channel("roleChange", s.role_change(worker), (m.RoleChange,),
                "Operator or planner to one worker: drain the old role, serve as this one.",
                "request", reply=m.DispatchReply),
        Channel("shedLoad", s.shed_load(worker), (m.ShedLoad,),
                "Planner to one decode worker: hand these many running requests back to be "
                "placed again.", "request", reply=m.DispatchReply),
    ]


def message_types() -> list[type[Message]]:
    """Every message that crosses a process, in definition order."""
    return [value for value in vars(messages).values()
            if isinstance(value, type) and issubclass(value, Message) and value is not Message]


def json_schemas() -> dict[str, dict[str, Any]]:
    """A standalone JSON Schema per message, by message name."""
    return {cls.__name__: {"$schema": "https://json-schema.org/draft/2020-12/schema",
                           **msgspec.json.schema(cls)} for cls in message_types()}


def asyncapi() -> dict[str, Any]:
    """The AsyncAPI 3.0 document of the contract."""
    buckets = Subjects("CLUSTERTOKEN")
    _, schemas = msgspec.json.schema_components(message_types(),
                                                ref_template="#/components/schemas/{name}")
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "halfmoon NATS contract",
            "version": SCHEMA_VERSION,
            "description": (
                "Every subject halfmoon uses, under halfmoon.{cluster}." + SCHEMA_VERSION +
                ". Payloads are JSON, tagged by message name in `type`. Channels tagged "
                "`public` are for outside subscribers; the rest are internal and may change "
                "between releases (within the evolution rules: new fields get defaults and "
                "go last, a field never changes type). KV bytes never travel on NATS. "
                "NATS KV buckets: " + _cluster_named(
                    f"{buckets.workers_bucket} (the latest WorkerHeartbeat of each live "
                    f"worker, by worker id), {buckets.transfer_bucket} (a TransferEndpoint "
                    "per transfer engine, by engine id). Object store: "
                    f"{buckets.snapshot_bucket} (object {buckets.prefix_snapshot}: the "
                    "conductors' PrefixIndexSnapshot).")),
        },
        "defaultContentType": "application/json",
        "channels": {**{channel.key: _channel(channel) for channel in channels()},
                     **{f"{channel.key}Reply": _reply_channel(channel.replies)
                        for channel in channels() if channel.replies}},
        "operations": {f"send{channel.key[0].upper()}{channel.key[1:]}": _operation(channel)
                       for channel in channels()},
        "components": {
            "messages": {cls.__name__: _message(cls) for cls in message_types()},
            "schemas": schemas,
        },
    }


def _channel(channel: Channel) -> dict[str, Any]:
    address = channel.address
    parameters = {}
    for token, (name, description) in _PARAMETERS.items():
        if token in address:
            address = address.replace(token, "{" + name + "}")
            parameters[name] = {"description": description}
    return {
        "address": address,
        "description": _cluster_named(f"{channel.summary} Delivery: {channel.delivery}."),
        "parameters": parameters,
        "messages": {cls.__name__: {"$ref": f"#/components/messages/{cls.__name__}"}
                     for cls in channel.messages},
        "tags": [{"name": "public" if channel.is_public else "internal"}],
    }


def _cluster_named(text: str) -> str:
    """Stream and bucket names with the cluster's name as a placeholder (stream names spell
    it upper-case, with `-` as `_`)."""
    return text.replace("CLUSTERTOKEN", "<cluster>")


def _operation(channel: Channel) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "action": "send",
        "channel": {"$ref": f"#/channels/{channel.key}"},
        "messages": [{"$ref": f"#/channels/{channel.key}/messages/{cls.__name__}"}
                     for cls in channel.messages],
    }
    if channel.replies:
        reply = f"#/channels/{channel.key}Reply"
        operation["reply"] = {"channel": {"$ref": reply}, "messages": [
            {"$ref": f"{reply}/messages/{cls.__name__}"} for cls in channel.replies]}
    return operation


def _reply_channel(replies: tuple[type[Message], ...]) -> dict[str, Any]:
    """The answer to a request: on the requester's NATS inbox, whose address is dynamic."""
    return {"address": None, "description": "The requester's reply inbox.",
            "messages": {cls.__name__: {"$ref": f"#/components/messages/{cls.__name__}"}
                         for cls in replies}}


def _message(cls: type[Message]) -> dict[str, Any]:
    doc = (cls.__doc__ or "").strip()
    return {"name": cls.__name__, "title": cls.__name__, "summary": doc.split("\n")[0],
            "payload": {"$ref": f"#/components/schemas/{cls.__name__}"}}


def write_contract(out_dir: Path) -> list[Path]:
    """Write every schema and the AsyncAPI document under `out_dir`; return the paths."""
    files = {Path("schemas") / f"{name}.json": schema
             for name, schema in json_schemas().items()}
    files[Path("asyncapi.json")] = asyncapi()
    written = []
    for relative, document in files.items():
        path = out_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=2) + "\n")
        written.append(path)
    return written
