"""raystream's tunable constants, in one place: values a person might change after measuring,
but that no deployment should need to set (docs/configuration.md lists the settings).

Each says why it is what it is. Protocol facts (frame layouts, field numbers, wire bounds)
stay in the modules that speak the protocol.
"""

from __future__ import annotations

# -- requests and limits (serve_app/core, serve_app/stages) ------------------------------------

# Longer request ids are refused (INVALID_ARGUMENT): an id is echoed in every answer and log line.
MAX_REQUEST_ID_CHARS = 256
# Pixels one request may make the decoder decode (after JPEG DCT scaling): images past it
# fail alone (INVALID_ARGUMENT). Bounds the CPU one request can ask for (5 x 40 MP images).
MAX_REQUEST_PIXELS = 200_000_000
# Decoding ~4 megapixels costs about 0.1 s of one core (a 16-bit PNG: 30 ns a pixel): such
# images use all but one decode thread at most (serve_app/stages/decode_pool.py).
HEAVY_PIXELS = 4_000_000
# Decode threads where the replica's num_cpus cannot be read (topology direct: the ingress
# decodes itself); PIL releases the GIL while it decodes.
DEFAULT_PREPROCESS_THREADS = 2
# Calls sent again after losing a stage replica (serving.py, _call): once covers a replica
# or node lost mid-call; a request that itself kills replicas (say, by memory) costs at most two.
STAGE_RETRIES = 1

# -- shutdown and health -----------------------------------------------------------------------

# Serve's default graceful_shutdown_timeout_s: what a replica may take to stop where its
# deployment's own setting cannot be read.
GRACEFUL_SHUTDOWN_S = 20.0
# What a stopping replica keeps of its graceful_shutdown_timeout_s for closing after its
# drain (stage links, registry report): Serve kills the process at the end of it.
DRAIN_MARGIN_S = 10.0
# An engine or nvJPEG call running longer is stuck (a hung GPU or runtime): the replica's
# health check fails and Serve replaces it.
ENGINE_STALL_TIMEOUT_S = 120.0
# A model version not loaded and warmed (graphs captured, first batch run) in this long is
# stuck: a replica loading it at start fails to start, one loading it at run time fails its
# health check, and the ingress withdraws a run-time load not ready everywhere by then.
LOAD_TIMEOUT_S = 600.0

# -- the model registry (serve_app/models) -----------------------------------------------------

POLL_S = 0.25  # how often replicas look at the desired state and report (a local read)
FRESH_S = 5.0  # a report not renewed for this long, on the store's clock, is of a replica gone
# How long a starting replica waits for the first one to write the initial state; past it
# (that replica died in between), it writes the state itself.
START_WAIT_S = 10.0
HEARTBEAT_S = 1.0  # how often a replica renews a report that has not changed
WATCH_S = 30.0  # a watch returns after this long even if nothing changed
EXPIRE_S = 0.5  # how often the registry actor drops the reports not renewed
IDLE_EXIT_S = 120.0  # a registry actor no replica has used for this long exits

# -- stage calls (serve_app/pipeline, serve_app/transport) -------------------------------------

# Serve's gRPC transport carries a call by value only where its message limit is at least
# this (a call's answers can pass the 4 MiB default), and only batches up to
# BY_VALUE_MAX_BYTES: larger ones ran slower by value, one thread carrying each
# (serve_app/pipeline/topology.py, StageHandle).
BY_VALUE_MIN_LIMIT = 256 << 20
BY_VALUE_MAX_BYTES = 4 << 20
# Shared memory each ingress replica may use for images handed to stage replicas on its
# node with stage_ports (serve_app/transport/shared_images.py): calls past it carry them.
SHARED_IMAGES_BYTES = 256 << 20
MIN_SEGMENT_BYTES = 32 << 20  # most calls fit one segment; bigger ones get one their size
MAPPINGS_KEPT = 64  # segments a callee keeps mapped (the callers' in-flight calls)
SWEEP_S = 1.0  # how often a callee drops the mappings of segments their writer removed
ADDRESS_POLL_S = 1.0  # how often a caller reads the stage replicas' addresses
CLOSE_GRACE_S = 30.0  # how long a stage link's connections get to finish their calls on close
FIRST_BACKOFF_S, MAX_BACKOFF_S = 1.0, 30.0  # an address that failed, before it is tried again
HELLO_TIMEOUT_S = 10.0  # for a caller's handshake, on the replica
# A caller's connect and handshake: a replica alive but cut off answers nothing, and its
# calls should go elsewhere soon (the kernel would retry the connect for minutes).
CONNECT_TIMEOUT_S = 2.0

# A peer whose host vanished or was cut off sends no reset: without these, calls waiting on
# its connection would wait until its address left the registry. Idle for KEEPALIVE_IDLE_S
# (a call waiting for its answer), the kernel probes and drops the connection after
# KEEPALIVE_PROBES unanswered, KEEPALIVE_INTERVAL_S apart; data unacknowledged for
# USER_TIMEOUT_S drops it too. The peer's kernel answers probes however busy the peer is.
# Either way the calls fail with LinkDown within about 2 s and go to another replica.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 1, 1, 1
USER_TIMEOUT_S = 2
# A Unix socket sends no more than its send buffer at once (wmem_default, 208 KiB on Linux),
# and each part costs both event loops a wakeup. Calls of 8 crops (1.2 MB), one at a time,
# on a 2-core CPU machine (bench/stage_link_local.py), per call against TCP to the node's
# address: with that buffer 1.4-5x the latency and 1.7-2.9x the CPU; with 2 MiB granted
# about even; with 8 MiB 0.55-0.8x the CPU. So the caller asks for UNIX_SEND_BUFFER_BYTES
# and keeps the socket only where the kernel grants at least UNIX_MIN_SEND_BUFFER_BYTES
# (Linux grants twice what is asked, up to twice net.core.wmem_max); else it calls by TCP.
UNIX_SEND_BUFFER_BYTES = 4 << 20
UNIX_MIN_SEND_BUFFER_BYTES = 2 << 20
# A replica whose process hangs (stopped, or its loop stuck) while its host lives: the
# kernel acknowledges the calls and answers the probes, so neither of the above fires. The
# replica beats every BEAT_S on a connection while it holds calls; a caller that has heard
# nothing for SILENT_S while a call waits drops the connection (LinkDown). Checked every
# BEAT_S / 2: a hung replica costs a call at most SILENT_S + BEAT_S / 2 = 1.75 s.
BEAT_S = 0.5
SILENT_S = 1.5

# -- batching and decode on the GPU (serve_app/stages) -----------------------------------------

# The most engine batches at once (an engine's `batches_at_once`): GPU engines hold this many
# slots (engines/cuda_graphs.py), and ONNX Runtime splits the cores between them.
MAX_CONCURRENT_BATCHES = 2
# JPEGs per nvJPEG call. One decode thread takes everything queued up to this: torchvision
# decodes under a process-wide lock anyway, and on an H200 a call of 64 costs 0.12 ms of CPU
# an image where calls of 8 from four threads cost 0.40 (bench/gpu_decode_bench.py).
DECODE_BATCH = 64

# -- the ingress (serve_app/protocol, serve_app/observability) ---------------------------------

# Below this, parsing a message whole and copying its images out costs less than walking its
# fields in Python (on a 2-core CPU machine, a request of 8 images of 5 KB: 3.9 against
# 10 us; of 86 KB: 38 against 16).
SPLIT_MIN_BYTES = 64 << 10
TRACE_EXPORT_DELAY_S = 5.0  # finished spans wait this long in a replica, then go in one batch


def drain_timeout_s(graceful_shutdown_timeout_s: float | None) -> float:
    """How long a stopping replica gives what it has read to be answered: its deployment's
    graceful_shutdown_timeout_s less DRAIN_MARGIN_S (at least half of it)."""
    graceful = (
        GRACEFUL_SHUTDOWN_S if graceful_shutdown_timeout_s is None else graceful_shutdown_timeout_s
    )
    return max(graceful - DRAIN_MARGIN_S, graceful / 2)


# -- the ingress' micro-batching (serve_app/core/dispatch.py, dispatch_rule.py) ----------------

# Calls in flight, from all ingress replicas together, per replica of the deployment they call.
CALLS_PER_CALLEE_REPLICA = 4
# A GPU replica batches the images of several calls: at least this many calls in flight per
# ingress replica keep its batches full while few replicas run.
MIN_CALLS_GPU = 8
# Requests a call carries at most: a call costs CPU whatever it carries, and on a GPU host
# more, smaller calls in flight kept more replicas busy (32 against 64 a call: one-image
# requests 1.12x the img/s; against 16: saturated 1.06x).
REQUESTS_PER_CALL_CPU = 64
REQUESTS_PER_CALL_GPU = 32
# On a CPU engine, the images a call carries past its first request, in engine batches:
# under a backlog, smaller calls end sooner and another stream's request goes sooner.
BATCHES_PER_CALL_CPU = 2
# A freed call slot waits this long for more requests while they arrive fast.
GATHER_S = 0.003
# A request that waited this long while every call stayed busy goes in an extra call.
SPILL_AFTER_S = 0.02
# How often the ingress reads the replica counts again.
RETUNE_S = 1.0
# Arrivals are counted over windows of this length: the last whole window's rate says
# whether more requests are expected within GATHER_S.
RATE_WINDOW_S = 0.1
