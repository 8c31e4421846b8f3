"""One frozen config struct per service, read once and passed down: every setting with its
type, default and description (its `--help` line). How they are read, from defaults, a
TOML file, the environment and flags: `shared/config_loading.py`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

EngineKind = Literal["torch", "fake", "sim"]
PrefillPolicy = Literal["least-loaded", "round-robin", "cache-aware", "seed", "longest-prefix"]


def about(text: str, **limits: float) -> msgspec.Meta:
    """A setting's description, its line in `halfmoon <service> --help` (every setting has
    one; `tests/unit/test_config.py` checks), and the range its value must lie in (`ge`,
    `gt`, `le`), checked when the settings are read: a zero batch budget or a negative
    timeout is refused at start, not found out as a hang."""
    return msgspec.Meta(description=text, **limits)


# Ranges of optional settings (a limit goes on the number, inside the `| None`).
Positive = Annotated[float, msgspec.Meta(gt=0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Share = Annotated[float, msgspec.Meta(ge=0, le=1)]


class NatsAuth(msgspec.Struct, frozen=True, kw_only=True):
    """How a service proves who it is to NATS, and checks who NATS is: a credentials file
    (JWT + nkey seed), an nkey seed file, a user and password, or a token; TLS with a CA to
    trust and, for mutual TLS, this service's certificate and key (file paths). Secrets are
    never logged nor put in an error message (the repr hides them)."""

    creds: Annotated[str | None, about("NATS credentials file (JWT and nkey seed)")] = \
        msgspec.field(default=None, name="nats_creds")
    nkey_seed: Annotated[str | None, about("NATS nkey seed file")] = \
        msgspec.field(default=None, name="nats_nkey_seed")
    user: Annotated[str | None, about("NATS user name")] = \
        msgspec.field(default=None, name="nats_user")
    password: Annotated[str | None, about("NATS password (never logged)")] = \
        msgspec.field(default=None, name="nats_password")
    token: Annotated[str | None, about("NATS token (never logged)")] = \
        msgspec.field(default=None, name="nats_token")
    tls_ca: Annotated[str | None, about("CA certificate file to check the NATS server's "
                                        "certificate against (TLS)")] = \
        msgspec.field(default=None, name="nats_tls_ca")
    tls_cert: Annotated[str | None, about("this service's certificate file, for mutual TLS "
                                          "with NATS")] = \
        msgspec.field(default=None, name="nats_tls_cert")
    tls_key: Annotated[str | None, about("this service's private key file, for mutual TLS "
                                         "with NATS")] = \
        msgspec.field(default=None, name="nats_tls_key")

    def __repr__(self) -> str:
        shown = {name: ("***" if name in ("password", "token") else value)
                 for name in self.__struct_fields__
                 if (value := getattr(self, name)) is not None}
        return f"NatsAuth({', '.join(f'{k}={v!r}' for k, v in shown.items())})"


class ServiceConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Settings every service shares."""

    nats_url: Annotated[str, about(
        "the NATS server; several servers of one NATS cluster comma-separated")] = \
        "nats://127.0.0.1:4222"
    nats: NatsAuth = msgspec.field(default_factory=NatsAuth)
    js_replicas: Annotated[int, about(
        "copies of every JetStream asset (request queue, KV events, registries) the NATS "
        "cluster keeps: 3 in the cluster deployments", ge=1, le=5)] = 1
    cluster: Annotated[str, about(
        "this halfmoon cluster's name: its subjects and buckets are named for it "
        "(`halfmoon.<cluster>.v1.`), so several clusters can share one NATS")] = "default"
    log_level: Annotated[str, about("debug, info, warning or error")] = "info"
    log_format: Annotated[Literal["auto", "json", "console"], about(
        "auto: JSON lines unless stderr is a terminal")] = "auto"
    drain_timeout_s: Annotated[float, about(
        "on SIGTERM, how long the work in flight may take to finish before the process "
        "exits", ge=0)] = 10.0
    connect_timeout_s: Annotated[float, about("how long to wait for NATS at start", gt=0)] = 10.0
    tracing: Annotated[Literal["auto", "off", "otlp-grpc", "otlp-http"], about(
        "OpenTelemetry traces over OTLP (shared/tracing.py); auto: on when "
        "OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT is set, with its protocol")] = "auto"
    otlp_endpoint: Annotated[str | None, about(
        "the OTLP collector (default: OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT)")] = None
    trace_sample_ratio: Annotated[Share | None, about(
        "the share of requests traced; default: OTEL_TRACES_SAMPLER[_ARG], else 1")] = None
    tracer: Annotated[Literal["lean", "sdk"], about(
        "lean: halfmoon's span objects, exported by the SDK; sdk: the OpenTelemetry SDK's "
        "own (slower; a fallback)")] = "lean"
    metrics_host: Annotated[str, about(
        "address of this process's Prometheus /metrics (the gateway serves its own on "
        "--port)")] = "127.0.0.1"
    metrics_port: Annotated[int, about("port of /metrics; 0: a free one, logged",
                                       ge=0, le=65535)] = 0


class GatewayConfig(ServiceConfig, frozen=True, kw_only=True):
    host: Annotated[str, about("address the HTTP API listens on")] = "127.0.0.1"
    port: Annotated[int, about("port of the HTTP API (/v1, /health, /metrics)",
                               ge=0, le=65535)] = 8000
    gateway_id: Annotated[str | None, about(
        "this gateway's id in subjects and logs, unique per gateway (default: a random "
        "one)")] = None
    model: Annotated[str, about(
        "the name of this gateway's own model in the API; it also serves every model a live "
        "worker serves")] = "halfmoon-tiny"
    max_model_len: Annotated[int, about(
        "the longest prompt + output a request may ask for, in tokens (cut to what the "
        "model and its workers hold)", ge=1)] = 2048
    api_key: Annotated[str | None, about(
        "the bearer token every /v1 request must carry (default: none asked)")] = None
    cors_origins: Annotated[str | None, about(
        "origins whose browser pages may call /v1 (CORS), comma-separated, or `*`")] = None
    client_trace_context: Annotated[bool, about(
        "continue the trace a request's W3C trace context (`traceparent`) names, as HTTP "
        "servers instrumented with OpenTelemetry do: its spans join the client's trace, and "
        "the client's sampled flag decides whether it is traced; off: every trace starts "
        "at the gateway, sampled by --trace-sample-ratio")] = True
    # Off by default: under `halfmoon up` each line costs the control path ~5 % throughput.
    access_log: Annotated[bool, about(
        "one `http.request` log line per generation request (method, path, status, "
        "duration)")] = False
    request_timeout_s: Annotated[float, about(
        "a request that makes no progress (no token) for this long fails with a 504", gt=0)] = 60.0
    heartbeat_timeout_s: Annotated[float, about(
        "a worker silent this long is lost: its streams fail over", gt=0)] = 2.0
    resume_after_s: Annotated[float, about(
        "a stream with no new token for this long asks its decode worker to send again what "
        "it may have lost (`StreamResume`), at most once per this interval", gt=0)] = 1.0
    chat_template_path: Annotated[str | None, about(
        "a Jinja2 chat template file in Hugging Face's format (default: the model's own, "
        "else ChatML)")] = None
    model_path: Annotated[str | None, about(
        "the own model's Hugging Face directory (default: the built-in model)")] = None
    tokenizer: Annotated[Literal["model", "bytes"], about(
        "model: the model's tokenizer; bytes: one token per byte (pairs with the fake and "
        "sim engines)")] = "model"
    sampling_defaults: Annotated[Literal["model", "openai"], about(
        "what a request that leaves temperature, top_p, top_k, min_p or repetition_penalty "
        "(or a chat request max_tokens) out gets: the model's generation_config.json (as "
        "vLLM and SGLang do), or OpenAI's defaults")] = "model"
    models_dir: Annotated[str | None, about(
        "other models' files, one directory each by model name (`<dir>/<model>`), for models "
        "whose workers' own directories this gateway cannot read")] = None
    scheduling_policy: Annotated[Literal["fcfs", "priority"], about(
        "fcfs: requests wait in arrival order, and a request's `priority` other than 0 is "
        "refused (as vLLM's default); priority: clients set `priority` (lower goes first) "
        "where requests wait: the conductor's lines for room, the engines' queues and "
        "preemption")] = "fcfs"
    responses_ttl_s: Annotated[float, about(
        "how long stored Responses API responses (`store`) are kept in NATS KV, for "
        "previous_response_id and GET /v1/responses/{id}; 0: none is stored", ge=0)] = 86400.0
    responses_max_bytes: Annotated[int, about(
        "the size of the stored responses' bucket; when full, the oldest go first", ge=1)] = 1 << 30


class PlannerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The planner (`services/conductor/planner.py`): `off`, or `slo`: move workers between
    prefill and decode to keep `ttft_slo_ms` / `tbt_slo_ms` (at least one must be set).
    Active in one conductor at a time (a lease in NATS KV). `high` and `low` are shares of
    the SLOs: move a worker when a role's pressure stays above `high` for `hold_s`; send
    moved workers home once both stay below `low` for `home_after_s`."""

    mode: Annotated[Literal["off", "slo"], about(
        "slo: move workers between prefill and decode to keep --ttft-slo-ms / "
        "--tbt-slo-ms")] = msgspec.field(default="off", name="planner")
    interval_s: Annotated[float, about(
        "how often the planner reads the load (and renews its lease)", gt=0)] = \
        msgspec.field(default=1.0, name="planner_interval_s")
    high: Annotated[float, about(
        "the share of an SLO over which a role is pressed: it takes workers", gt=0)] = \
        msgspec.field(default=0.8, name="planner_high")
    low: Annotated[float, about(
        "the share of the SLOs under which both roles are at ease: moved workers go "
        "home", ge=0)] = msgspec.field(default=0.3, name="planner_low")
    hold_s: Annotated[float, about(
        "how long a role must stay pressed before a worker moves to it", ge=0)] = \
        msgspec.field(default=3.0, name="planner_hold_s")
    cooldown_s: Annotated[float, about("the least time between two moves", ge=0)] = \
        msgspec.field(default=10.0, name="planner_cooldown_s")
    home_after_s: Annotated[float, about(
        "how long both roles must stay at ease before moved workers go home", ge=0)] = \
        msgspec.field(default=60.0, name="planner_home_after_s")


class ConductorConfig(ServiceConfig, frozen=True, kw_only=True):
    heartbeat_timeout_s: Annotated[float, about(
        "a worker silent this long is lost: its requests are placed again", gt=0)] = 2.0
    dispatch_timeout_s: Annotated[float, about(
        "how long a worker has to accept a command before it is taken as refused", gt=0)] = 2.0
    max_placement_attempts: Annotated[int, about(
        "placements tried per request before it fails", ge=1)] = 3
    num_fetchers: Annotated[int, about(
        "pulls kept open on the request queue (each replica)", ge=1)] = 4
    request_max_age_s: Annotated[float, about(
        "how long a gateway waits for a request that does not say (each says, from its "
        "gateway's --request-timeout-s, since `wait_s`): older, it is dropped as expired; "
        "and the request stream's least max age", gt=0)] = 60.0
    # Long enough for a restart (the launcher's, or a pod's whose model loads quickly), a
    # worker stalled for a while (a long pause, swapping) and one whose NATS node was cut off
    # (3 s of unanswered pings, then another node). The wait costs nothing when the worker
    # is back sooner: its first heartbeat lets the line go.
    no_worker_hold_s: Annotated[float, about(
        "a request that finds no healthy worker of a role waits this long, in its model's "
        "line, for one to come back (a restart, a stalled worker, a healed partition, a "
        "NATS node lost) before its 503", ge=0)] = 30.0
    # By default as long as its client waits: a burst that takes longer than a fixed hold to
    # drain got 429s in its tail, where colocated workers queue it and serve it all.
    kv_short_hold_s: Annotated[NonNegative | None, about(
        "a request that finds no room (no decode worker with KV room, every prefill "
        "queue full) waits this long (at most the TTFT SLO), in its model's line, for "
        "running requests to free some before its 429 (default, and at most: while its "
        "gateway waits, until 2 s before); 0: refuse at once")] = None
    policy: Annotated[PrefillPolicy, about("how a prefill worker is chosen")] = "cache-aware"
    ttft_slo_ms: Annotated[Positive | None, about(
        "reject a request (429) when the best predicted time to first token exceeds "
        "it")] = None
    tbt_slo_ms: Annotated[Positive | None, about(
        "reject a request (429) when the best predicted decode step exceeds it")] = None
    default_prefill_tokens_per_s: Annotated[float, about(
        "the prefill rate assumed for workers that have not measured theirs yet", gt=0)] = 2000.0
    prefix_index_max_blocks: Annotated[int, about(
        "cached blocks the global prefix index keeps (LRU)", ge=1)] = 1_000_000
    prefix_fetch: Annotated[bool, about(
        "fetch a longer cached prefix from the prefill worker holding it when moving its KV "
        "costs less than computing it")] = True
    transfer_bytes_per_s: Annotated[float, about(
        "the KV transfer rate prefix fetches are costed at", gt=0)] = 2e9
    transfer_overhead_s: Annotated[float, about(
        "the fixed cost of one prefix fetch", ge=0)] = 0.002
    prefix_snapshot_interval_s: Annotated[float, about(
        "how often the prefix index is saved (NATS object store) for a restarting conductor "
        "to resume from, with the KV events after it; 0: never", ge=0)] = 30.0
    prefix_catch_up_timeout_s: Annotated[float, about(
        "how long a starting conductor waits for its prefix index to catch up", ge=0)] = 30.0
    planning: PlannerSettings = msgspec.field(default_factory=PlannerSettings)


class EngineSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Which engine runs the model, on what, and how big its batches and KV pool are."""

    kind: Annotated[EngineKind, about(
        "torch: the model; fake: fixed tokens at set delays; sim: a simulated accelerator "
        "(--sim-profile)")] = msgspec.field(default="torch", name="engine")
    model_path: Annotated[str | None, about(
        "the model's Hugging Face directory (default: the built-in model)")] = None
    dtype: Annotated[Literal["float32", "bfloat16"], about(
        "weights, activations and KV")] = "float32"
    device: Annotated[str, about("cpu, cuda or cuda:N")] = "cpu"
    attention_backend: Annotated[
        Literal["auto", "torch", "inductor", "flex", "flashinfer", "reference"], about(
            "one attention call per layer (engine/attention.py); inductor: torch with decode "
            "steps of six or more sequences through a kernel compiled at start that reads "
            "the paged pool in place (CPU); auto: flashinfer on CUDA when it imports, "
            "inductor for bf16 on a CPU without AMX, else torch; "
            "reference: the per-sequence loop the others are tested against")] = "auto"
    # On a CPU without bf16 units: fp32 in oneDNN's layout, twice a bf16 model's weight
    # memory; plain there prefills 2048-token prompts ~10 % faster, decodes a bf16 model
    # ~10-20 % faster at batch 1 and ~2x slower at batch 8.
    cpu_weights: Annotated[Literal["packed", "plain"], about(
        "linear weights on a CPU (engine/linear.py): packed as measured fastest for decode, "
        "or plain as loaded")] = "packed"
    max_model_len: Annotated[int, about(
        "the longest prompt + output a sequence may reach, in tokens", ge=1)] = 2048
    num_blocks: Annotated[int, about(
        "KV pool size in blocks (unless --kv-cache-memory-gb sizes it)", ge=1)] = 4096
    kv_cache_memory_gb: Annotated[float, about(
        "the KV pool sized from memory: GiB for KV on any device (0: --num-blocks, or on "
        "CUDA --gpu-memory-utilization)", ge=0)] = 0.0
    gpu_memory_utilization: Annotated[float, about(
        "on CUDA, the share of device memory for weights + KV", gt=0, le=1)] = 0.9
    block_size: Annotated[int, about("tokens per KV block", ge=1)] = 16
    max_batch_size: Annotated[int, about("sequences per engine step", ge=1)] = 64
    max_batch_tokens: Annotated[int, about(
        "tokens per engine step; a longer prompt prefills in chunks", ge=1)] = 2048
    prefill_max_wait_ms: Annotated[float, about(
        "how long a prompt may wait for others to batch with (dynamic batching)", ge=0)] = 10.0
    enable_prefix_caching: Annotated[bool, about(
        "reuse the KV of prompt prefixes computed before")] = True
    cuda_graphs: Annotated[bool, about(
        "replay decode steps as CUDA graphs, one per (batch, context) bucket, captured at "
        "start (engine/decode_graphs.py); needs --device cuda and the torch attention "
        "backend")] = False


class TransferSettings(msgspec.Struct, frozen=True, kw_only=True):
    """KV transfer, for engines with a KV pool: where this worker's transfer engine listens,
    what peers dial, the transports it may use (in preference order), the shared secret every
    worker of the cluster holds, whether KV streams layer by layer or after prefill, and how
    long a KV handoff may take."""

    host: Annotated[str, about("address the transfer engine listens on")] = \
        msgspec.field(default="127.0.0.1", name="transfer_host")
    port: Annotated[int, about("port of the transfer engine; 0: a free one", ge=0, le=65535)] = \
        msgspec.field(default=0, name="transfer_port")
    advertise_host: Annotated[str | None, about(
        "the address peers dial (default: --transfer-host)")] = \
        msgspec.field(default=None, name="transfer_advertise_host")
    transports: Annotated[str, about(
        "transports in preference order, comma-separated: cuda (GPU to GPU on one host, for "
        "a pool on a GPU), shm (one host), tcp, rdma")] = \
        msgspec.field(default="cuda,shm,tcp", name="transfer_transports")
    secret: Annotated[str, about(
        "the secret every worker of the cluster shares to authenticate KV transfers "
        "(never logged)")] = msgspec.field(default="", name="transfer_secret")
    kv_streaming: Annotated[Literal["layerwise", "whole"], about(
        "layerwise: KV moves to decode layer by layer while prefill runs; whole: after "
        "it")] = "layerwise"
    kv_transfer_dtype: Annotated[Literal["none", "fp8", "int8"], about(
        "KV this worker sends, quantized on the wire per 256 values with a float32 scale "
        "and dequantized into the receiver's pool: about 2x fewer bytes from a bf16 pool, "
        "4x from fp32; TCP only (shm moves KV as is)")] = "none"
    kv_wait_timeout_s: Annotated[float, about(
        "how long a KV handoff or prefix fetch may take", gt=0)] = 10.0
    kv_hold_s: Annotated[float, about(
        "after a handoff to a decode worker failed, how long prefill keeps the computed KV "
        "while the conductor places the decode side again", ge=0)] = 10.0


class SimSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The simulated engine: a model on an accelerator (engine/sim_cost.py PROFILES), its
    steps slowed by `time_scale` (wall s per simulated s), its KV bytes divided by
    `kv_byte_scale`; its KV capacity is what the profile's device memory holds. Its KV
    handoffs take the time of the full bytes over a link of `link_bytes_per_s` (50 GB/s: one
    400 Gb/s RDMA NIC per device; 0: only the real, scaled-down transfer's time). A worker
    whose `model` names a profile simulates that profile (so a model switch changes it)."""

    profile: Annotated[str, about(
        "the simulated model and accelerator (engine/sim_cost.py PROFILES)")] = \
        msgspec.field(default="llama-3-8b-h200", name="sim_profile")
    time_scale: Annotated[float, about("wall seconds per simulated second", gt=0)] = \
        msgspec.field(default=1.0, name="sim_time_scale")
    kv_byte_scale: Annotated[int, about(
        "the real KV bytes moved are the simulated ones divided by this", ge=1)] = \
        msgspec.field(default=4096, name="sim_kv_byte_scale")
    link_bytes_per_s: Annotated[float, about(
        "the simulated KV link (50 GB/s: a 400 Gb/s RDMA NIC); 0: only the real transfer's "
        "time", ge=0)] = msgspec.field(default=50e9, name="sim_link_bytes_per_s")
    load_bytes_per_s: Annotated[float, about(
        "the simulated weight load rate, at start and at each model switch; 0: "
        "instant", ge=0)] = msgspec.field(default=0.0, name="sim_load_bytes_per_s")


class FakeSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The fake engine's costs: per prefill batch, plus per uncached prompt token, and per
    decode step."""

    prefill_delay_s: Annotated[float, about("the fake engine's time per prefill batch", ge=0)] = \
        msgspec.field(default=0.0, name="fake_prefill_delay_s")
    prefill_s_per_token: Annotated[float, about(
        "the fake engine's time per uncached prompt token", ge=0)] = \
        msgspec.field(default=0.0, name="fake_prefill_s_per_token")
    token_delay_s: Annotated[float, about("the fake engine's time per decode step", ge=0)] = \
        msgspec.field(default=0.0, name="fake_token_delay_s")


class WorkerConfig(ServiceConfig, frozen=True, kw_only=True):
    """Settings of a prefill or decode worker, nested by concern. Flags, environment
    variables and TOML keys stay flat (`--num-blocks`, `HALFMOON_TRANSFER_HOST`,
    `sim_profile = ...`): each nested field's encoded name is its flat name."""

    worker_id: Annotated[str | None, about(
        "this worker's id, unique in the cluster (default: a random one)")] = None
    role: Annotated[Literal["prefill", "decode"], about(
        "the role the worker starts in; a RoleChange (the planner, `halfmoon assign`) "
        "switches it")] = "prefill"
    model: Annotated[str, about("the name of the model this worker serves")] = "halfmoon-tiny"
    models_dir: Annotated[str | None, about(
        "models this worker may be told to serve instead: one Hugging Face directory per "
        "model, named by the model (`<dir>/<model>`)")] = None
    host_name: Annotated[str | None, about(
        "the host this worker reports (default: the machine's host name)")] = None
    max_queue: Annotated[int, about(
        "prefill requests held at once; more are refused and placed elsewhere", ge=1)] = 256
    heartbeat_interval_s: Annotated[float, about(
        "how often the worker heartbeats: at most half the gateway's and conductor's "
        "--heartbeat-timeout-s (`halfmoon up` checks)", gt=0)] = 0.5
    compute_score: Annotated[float, about(
        "this worker's speed relative to the others (placement)", gt=0)] = 1.0
    zone: Annotated[str, about(
        "the network zone: placement prefers prefill workers in the decode worker's")] = ""
    local_prefill_max_tokens: Annotated[int, about(
        "decode only: prompts of at most this many tokens are prefilled here, not on a "
        "prefill worker (conditional disaggregation; 0: off)", ge=0)] = 0
    engine: EngineSettings = msgspec.field(default_factory=EngineSettings)
    transfer: TransferSettings = msgspec.field(default_factory=TransferSettings)
    sim: SimSettings = msgspec.field(default_factory=SimSettings)
    fake: FakeSettings = msgspec.field(default_factory=FakeSettings)
