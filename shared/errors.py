"""Typed errors shared by every service.

Each error knows its wire code (sent in `RequestFailed`) and how the gateway shows it to an
OpenAI client (HTTP status, error type). Wrap foreign exceptions with `raise ... from`.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """Stable error codes on the wire (part of the public message contract)."""

    INVALID_REQUEST = "invalid_request"
    CAPACITY_EXHAUSTED = "capacity_exhausted"
    WORKER_UNAVAILABLE = "worker_unavailable"
    ENGINE_FAILURE = "engine_failure"
    TRANSFER_FAILED = "transfer_failed"
    TRANSFER_TIMEOUT = "transfer_timeout"
    TIMEOUT = "timeout"
    ABORTED = "aborted"
    MOVED = "moved"


class HalfmoonError(Exception):
    """Base of every error halfmoon raises on purpose."""

    code: ErrorCode = ErrorCode.ENGINE_FAILURE
    http_status: int = 500
    error_type: str = "server_error"
    openai_code: str | None = None  # the `code` OpenAI clients know, where one exists
    # Sending the same request again cannot succeed, though its status is one clients retry
    # (a 429): the gateway tells them not to (`x-should-retry: false`).
    is_final: bool = False

    def __init__(self, message: str, *, param: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s


class InvalidRequest(HalfmoonError):
    """The request is malformed or breaks a limit; the client must change it."""

    code = ErrorCode.INVALID_REQUEST
    http_status = 400
    error_type = "invalid_request_error"


class UnsupportedParameter(InvalidRequest):
    """A request field halfmoon does not implement (or does not know): refused, never
    silently ignored."""

    openai_code = "unsupported_parameter"


class ContextLengthExceeded(InvalidRequest):
    """Prompt plus requested tokens do not fit the model's context window."""

    openai_code = "context_length_exceeded"


class RequestTooLarge(InvalidRequest):
    """The request, tokenized, is larger than the cluster's message bus carries in one message
    (the NATS server's `max_payload`): it fits the model but not this deployment."""


class AuthenticationFailed(HalfmoonError):
    code = ErrorCode.INVALID_REQUEST
    http_status = 401
    error_type = "authentication_error"
    openai_code = "invalid_api_key"


class ModelNotFound(HalfmoonError):
    code = ErrorCode.INVALID_REQUEST
    http_status = 404
    error_type = "invalid_request_error"
    openai_code = "model_not_found"


class ResponseNotFound(HalfmoonError):
    """A stored Responses API response that does not exist (never stored, deleted, or past
    its time to live)."""

    code = ErrorCode.INVALID_REQUEST
    http_status = 404
    error_type = "invalid_request_error"


class PreviousResponseNotFound(InvalidRequest):
    """`previous_response_id` names no stored response."""

    openai_code = "previous_response_not_found"


class CapacityExhausted(HalfmoonError):
    """No worker can take the request now (queues full, KV blocks exhausted)."""

    code = ErrorCode.CAPACITY_EXHAUSTED
    http_status = 429
    error_type = "rate_limit_error"


class KvNeverFits(CapacityExhausted):
    """The request alone needs more KV than any decode worker's whole pool: the cluster's
    capacity refuses it (a 429), not its form, and no wait changes that."""

    is_final = True


class Shortage(CapacityExhausted):
    """No worker has room for the request now, though one will as running requests finish:
    the request waits at the conductor (its hold) before its 429, which tells the client to
    try again in `RETRY_AFTER_S` (running requests finish all the time)."""

    RETRY_AFTER_S = 1.0

    def __init__(self, message: str, *, retry_after_s: float | None = RETRY_AFTER_S) -> None:
        super().__init__(message, retry_after_s=retry_after_s)


class KvShortage(Shortage):
    """No decode worker has KV room for the request now."""


class PrefillQueuesFull(Shortage):
    """Every prefill worker's queue is full now (as its heartbeat and what was sent to it
    since say): it takes more as its prefills finish."""


class SloViolation(CapacityExhausted):
    """Admission predicted that the request would break a TTFT or TBT SLO; `role` is the one
    short of capacity: prefill for the TTFT, decode for the time between tokens."""

    def __init__(self, message: str, *, role: str, retry_after_s: float | None = None
                 ) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.role = role


class WorkerUnavailable(HalfmoonError):
    """No healthy worker of a needed role is alive."""

    code = ErrorCode.WORKER_UNAVAILABLE
    http_status = 503
    error_type = "service_unavailable"


class NoHealthyWorker(WorkerUnavailable):
    """No worker of a needed role (`role`, "" when unsaid) is healthy at this moment; one
    may come back (a restart, a healed partition), so the conductor holds the request a
    little before giving up."""

    def __init__(self, message: str, *, role: str = "", retry_after_s: float | None = None
                 ) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.role = role


class ModelLoading(NoHealthyWorker):
    """No healthy worker serves the model in a role, and one was told to load it: the
    conductor holds the request for its expected `load_s` on top of the usual hold."""

    def __init__(self, message: str, *, role: str = "", load_s: float) -> None:
        super().__init__(message, role=role, retry_after_s=load_s)
        self.load_s = load_s


class NobodyListens(WorkerUnavailable):
    """No one subscribes to the subject a request went to (NATS answered "no responders"):
    the service behind it is gone, not slow."""


class WorkerLost(WorkerUnavailable):
    """A worker serving the request stopped heartbeating; the gateway places it again.
    `worker_id` names it ("" for a conductor's move, which names none)."""

    def __init__(self, message: str, *, worker_id: str = "",
                 retry_after_s: float | None = None) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.worker_id = worker_id


class RequestMoved(WorkerLost):
    """A decode worker handed the request back to be placed again (its load shed to idler
    workers, `ShedLoad`); the gateway places the rest of it as after a lost worker."""

    code = ErrorCode.MOVED


class EngineFailure(HalfmoonError):
    code = ErrorCode.ENGINE_FAILURE


class TransferFailed(HalfmoonError):
    code = ErrorCode.TRANSFER_FAILED


class TransferTimeout(HalfmoonError):
    code = ErrorCode.TRANSFER_TIMEOUT
    http_status = 504
    error_type = "timeout"


class RequestTimeout(HalfmoonError):
    """A request made no progress within its deadline."""

    code = ErrorCode.TIMEOUT
    http_status = 504
    error_type = "timeout"


class RequestAborted(HalfmoonError):
    code = ErrorCode.ABORTED
    http_status = 499
    error_type = "aborted"


class ServiceStartFailed(HalfmoonError):
    """A service could not start; it has been stopped again and holds no resources."""


class ConfigError(HalfmoonError):
    """A flag, environment variable or config file holds a bad value."""


_BY_CODE: dict[ErrorCode, type[HalfmoonError]] = {
    ErrorCode.INVALID_REQUEST: InvalidRequest,
    ErrorCode.CAPACITY_EXHAUSTED: CapacityExhausted,
    ErrorCode.WORKER_UNAVAILABLE: WorkerUnavailable,
    ErrorCode.ENGINE_FAILURE: EngineFailure,
    ErrorCode.TRANSFER_FAILED: TransferFailed,
    ErrorCode.TRANSFER_TIMEOUT: TransferTimeout,
    ErrorCode.TIMEOUT: RequestTimeout,
    ErrorCode.ABORTED: RequestAborted,
    ErrorCode.MOVED: RequestMoved,
}


def error_from_code(code: ErrorCode, message: str, retry_after_s: float | None = None,
                    param: str | None = None, *, is_final: bool = False) -> HalfmoonError:
    """Rebuild the typed error a peer reported in a `RequestFailed` message."""
    error = _BY_CODE.get(code, EngineFailure)(message, retry_after_s=retry_after_s,
                                              param=param)
    error.is_final = is_final
    return error
