"""Typed errors of the transfer engine. Every one is a `TransferFailed` or a `TransferTimeout`
(shared/errors.py), so a caller that only cares whether the bytes landed catches those two."""

from __future__ import annotations

from shared.errors import TransferFailed, TransferTimeout

__all__ = [
    "AuthenticationRefused",
    "InvalidTransfer",
    "PeerNotFound",
    "PeerRestarted",
    "ProtocolViolation",
    "TransferFailed",
    "TransferTimeout",
]


class PeerNotFound(TransferFailed):
    """No descriptor is known for the peer: not in the registry, not reachable directly."""


class PeerRestarted(TransferFailed):
    """The peer's engine restarted since the caller learned the addresses of this transfer
    (its incarnation changed): they are not the new process's to write, and the old one's
    memory is gone."""


class AuthenticationRefused(TransferFailed):
    """The handshake failed: a wrong shared secret on one side or the other."""


class InvalidTransfer(TransferFailed):
    """A piece names an unknown segment, falls outside its segment, or the batch is malformed.
    Raised before any byte moves when the caller's own batch is bad; sent back by a peer that
    refused a request."""


class ProtocolViolation(TransferFailed):
    """The peer sent bytes that are not our wire protocol (bad magic, version, op or sizes);
    the connection is closed."""
