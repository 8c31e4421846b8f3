"""Least-privilege NATS users for one halfmoon cluster.

One user per service role and one per gateway (a gateway reads only its own tokens), each
allowed to publish and subscribe to exactly the subjects its role uses: the core subjects of
`Subjects` and the JetStream API of the streams, KV buckets and object store that role
touches. `authorization_conf` renders them as a nats-server `authorization` block (JSON is
valid nats-server configuration); `halfmoon nats-auth` writes it with a fresh nkey per user.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec
import nkeys

from shared.subjects import Subjects

# "worker": a worker that may serve either role, switched at runtime (`RoleChange`).
ROLES = ("gateway", "conductor", "prefill", "decode", "worker")


class Permissions(msgspec.Struct, frozen=True):
    """Subjects a user may publish to and subscribe to (NATS wildcards allowed). Replies to
    the requests a user receives are allowed on top (nats-server's `allow_responses`)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


class NatsUser(msgspec.Struct, frozen=True, kw_only=True):
    """A user of the `authorization` block: a name and password, or an nkey (public key)."""

    name: str
    permissions: Permissions
    password: str | None = None
    nkey: str | None = None


def permissions(role: str, subjects: Subjects, gateway_id: str | None = None) -> Permissions:
    """What a service of `role` may do on the bus of `subjects`' cluster. A gateway's
    permissions name its own `gateway_id`: it subscribes to its tokens and no other's."""
    if role == "gateway":
        if gateway_id is None:
            raise ValueError("a gateway's permissions name its gateway id")
        return _gateway(subjects, gateway_id)
    return {"conductor": _conductor, "prefill": _prefill, "decode": _decode,
            "worker": _either_role}[role](subjects)


def _gateway(s: Subjects, gateway_id: str) -> Permissions:
    return Permissions(
        publish=(s.requests, s.abort, _any(s.stream_resume), s.all_request_events,
                 # MSG.DELETE: a request its client left, out of the queue (`generation`).
                 *_stream_api(s.requests_stream, "INFO", "CREATE", "UPDATE", "MSG.DELETE"),
                 *_bucket_reader(s.workers_bucket), *_bucket_writer(s.responses_bucket)),
        subscribe=(_INBOX, s.gateway(gateway_id), s.all_heartbeats))


def _conductor(s: Subjects) -> Permissions:
    return Permissions(
        publish=(_any(s.prefill_task), _any(s.decode_reserve), s.abort, _any(s.gateway),
                 s.all_request_events, _any(s.role_change), _any(s.shed_load),
                 *_stream_api(s.requests_stream, "INFO", "CREATE", "UPDATE"),
                 *_consumer_api(s.requests_stream), f"$JS.ACK.{s.requests_stream}.>",
                 *_stream_api(s.kv_events_stream, "INFO", "CREATE", "UPDATE"),
                 *_consumer_api(s.kv_events_stream), f"$JS.FC.{s.kv_events_stream}.>",
                 *_object_store(s.snapshot_bucket), *_bucket_reader(s.workers_bucket),
                 *_bucket_writer(s.planner_bucket)),
        subscribe=(_INBOX, s.all_heartbeats, s.decode_replacement, s.abort))


def _worker(s: Subjects, role: str) -> tuple[str, ...]:
    """What prefill and decode workers both publish: heartbeats, prefix-cache events, the
    registries (their own entries), failures to the gateways, lifecycle events."""
    return (s.role_heartbeats(role), _any(s.kv_events), _any(s.gateway), s.abort, s.all_events,
            *_stream_api(s.kv_events_stream, "INFO", "CREATE", "UPDATE"),
            *_bucket_writer(s.workers_bucket), *_bucket_writer(s.transfer_bucket))


def _prefill(s: Subjects) -> Permissions:
    return Permissions(
        publish=(*_worker(s, "prefill"), _any(s.kv_commit), _any(s.kv_lease_renewal),
                 _any(s.prefix_fetch), s.decode_replacement),
        subscribe=(_INBOX, _any(s.prefill_task), _any(s.kv_target), _any(s.prefix_fetch),
                   s.abort, _any(s.role_change)))


def _decode(s: Subjects) -> Permissions:
    return Permissions(
        publish=(*_worker(s, "decode"), _any(s.kv_target)),
        subscribe=(_INBOX, _any(s.decode_reserve), _any(s.kv_commit), _any(s.stream_resume),
                   _any(s.kv_lease_renewal), s.role_heartbeats("prefill"), s.abort,
                   _any(s.role_change), _any(s.shed_load)))


def _either_role(s: Subjects) -> Permissions:
    """A worker that may be switched between the roles: what either does. (A `prefill` or
    `decode` user hears a `RoleChange` too, but cannot serve the other role.)"""
    prefill, decode = _prefill(s), _decode(s)
    return Permissions(publish=_union(prefill.publish, decode.publish),
                       subscribe=_union(prefill.subscribe, decode.subscribe))


def _union(*lists: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(subject for subjects in lists for subject in subjects))


_ID = "id-placeholder"


def _any(subject_of: Callable[[str], str]) -> str:
    """The subject `subject_of` gives, for every id (the `*` wildcard in the id's place)."""
    return subject_of(_ID).replace(_ID, "*")


# Replies (to requests and to JetStream API calls) come to the requester's inbox.
_INBOX = "_INBOX.>"


def _stream_api(stream: str, *verbs: str) -> tuple[str, ...]:
    return tuple(f"$JS.API.STREAM.{verb}.{stream}" for verb in verbs)


def _consumer_api(stream: str) -> tuple[str, ...]:
    """Create, look up, pull from and delete consumers of `stream`."""
    return (f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.*", f"$JS.API.CONSUMER.INFO.{stream}.*",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*", f"$JS.API.CONSUMER.DELETE.{stream}.*")


def _bucket_reader(bucket: str) -> tuple[str, ...]:
    stream = f"KV_{bucket}"
    return (*_stream_api(stream, "INFO", "CREATE", "UPDATE"), *_consumer_api(stream),
            f"$JS.API.DIRECT.GET.{stream}.>", f"$JS.API.STREAM.MSG.GET.{stream}",
            f"$JS.FC.{stream}.>")


def _bucket_writer(bucket: str) -> tuple[str, ...]:
    return (*_bucket_reader(bucket), f"$KV.{bucket}.>")


def _object_store(bucket: str) -> tuple[str, ...]:
    stream = f"OBJ_{bucket}"
    return (*_stream_api(stream, "INFO", "CREATE", "UPDATE", "PURGE"), *_consumer_api(stream),
            f"$JS.API.DIRECT.GET.{stream}.>", f"$JS.API.STREAM.MSG.GET.{stream}",
            f"$O.{bucket}.>", f"$JS.FC.{stream}.>")


def role_users(subjects: Subjects, gateway_ids: Iterable[str]) -> list[tuple[str, Permissions]]:
    """(user name, permissions) for every role, a gateway user per id named after it."""
    users = [(gateway_id, permissions("gateway", subjects, gateway_id))
             for gateway_id in gateway_ids]
    return users + [(role, permissions(role, subjects)) for role in ROLES[1:]]


def authorization_conf(users: Iterable[NatsUser]) -> str:
    """A nats-server `authorization` block holding `users`, each under a comment naming it
    (its entries are JSON, which nats-server reads)."""
    lines = ["authorization: {", "  users: ["]
    for user in users:
        entry: dict[str, object] = (
            {"nkey": user.nkey} if user.nkey is not None
            else {"user": user.name, "password": user.password})
        entry["permissions"] = {
            "publish": {"allow": list(user.permissions.publish)},
            "subscribe": {"allow": list(user.permissions.subscribe)},
            "allow_responses": True,
        }
        lines += [f"    # {user.name}", f"    {json.dumps(entry)}"]
    return "\n".join([*lines, "  ]", "}", ""])


def new_nkey_seed() -> bytes:
    """A fresh user nkey seed (`SU...`), as nats-py's `nkeys_seed` option reads it."""
    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)


def public_nkey(seed: bytes) -> str:
    return nkeys.from_seed(bytearray(seed)).public_key.decode()


def write_nkey_users(out_dir: Path, subjects: Subjects, gateway_ids: Iterable[str]) -> list[Path]:
    """A fresh nkey per user: `<user>.nk` seed files (mode 0600, one per service identity)
    and `users.conf`, the authorization block naming their public keys. Returns the files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    users, written = [], []
    for name, allowed in role_users(subjects, gateway_ids):
        seed = new_nkey_seed()
        seed_file = out_dir / f"{name}.nk"
        seed_file.touch(mode=0o600)
        seed_file.write_bytes(seed + b"\n")
        written.append(seed_file)
        users.append(NatsUser(name=name, permissions=allowed, nkey=public_nkey(seed)))
    conf = out_dir / "users.conf"
    conf.write_text(f"# halfmoon cluster {subjects.cluster!r}: one nkey user per service "
                    "identity (halfmoon nats-auth)\n" + authorization_conf(users))
    return [conf, *written]
