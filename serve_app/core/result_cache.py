"""The ingress' result cache: each image's answer, kept by the hash of its bytes and what was
asked of it, so a repeated image skips every stage; and one engine pass for identical images
in flight at once (in-flight dedup).

Only the serving core (serve_app/core/serving.py) uses it, and only where `cache.max_bytes` is
set: there a hit costs a hash and a dict lookup, not a Ray call, a decode and an engine pass.

- **Key**: BLAKE3 (a cryptographic hash, so no client can make an image collide with
  another's; 2.7x SHA-256's speed on the ingress' CPUs: 18 against 48 us for an 84 KB JPEG) of
  what decides the image's answer: the model version ("name/version", never the default
  alias, so a new version never answers with an old one's results) and the number of the
  routing that serves it (a version unloaded and loaded again starts afresh), the protocol, what was
  asked (v1: top_k where labels were asked, the embedding; OIP: each output's kind and k),
  then the image's bytes. 16 bytes of it.
- **Value**: the image's fragment of its answer (messages.Fragment), from which
  serve_app/wire/answers.py builds the answer as it does for the stages.
- **Not kept**: per-image failures, client pixel tensors (`Job.pixels`), jobs of no image.
- **Bounded**: least recently used entries go once keys and fragments (with
  `ENTRY_OVERHEAD` each) pass `cache.max_bytes`.

A request (`_Request`) finds each of its images in the cache, or waits for a request that
is computing the same key (a `_Flight`), or computes it: those images go to the stages as one
`Part`, a job of only them. The leader's answer fills every waiter and the cache. A leader
that fails as a whole or is dropped (deadline, stream gone), or whose image fails, releases
its waiters: they look their images up again and send them themselves where needed.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import blake3

from serve_app.core.messages import Answer, Failure, Fragment, Job, Served, StageTiming
from serve_app.wire.answers import failed, oip_answer, oip_widths, v1_answer
from serve_app.wire.request_images import buffers, pick

# What an entry costs beyond its key's and fragment's bytes: the OrderedDict's node and the
# objects' headers (tracemalloc: ~140 bytes for a v1 fragment, a node of ~75 and two bytes
# objects' 33 each; ~280 for an OIP fragment of three rows).
ENTRY_OVERHEAD = 200
KEY_BYTES = 16


def _size(key: bytes, fragment: Fragment) -> int:
    data = len(fragment) if isinstance(fragment, bytes) else sum(map(len, fragment))
    return ENTRY_OVERHEAD + len(key) + data


class ResultCache:
    """Fragments by key, least recently used first out, bounded in bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.evictions = 0
        self._entries: collections.OrderedDict[bytes, Fragment] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> Fragment | None:
        fragment = self._entries.get(key)
        if fragment is not None:
            self._entries.move_to_end(key)
        return fragment

    def put(self, key: bytes, fragment: Fragment) -> None:
        size = _size(key, fragment)
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= _size(key, old)
        self._entries[key] = fragment
        self.bytes += size
        while self.bytes > self.max_bytes:
            evicted, fragment = self._entries.popitem(last=False)
            self.bytes -= _size(evicted, fragment)
            self.evictions += 1


def asked(job: Job, routing: int = 0) -> bytes:
    """What, beside an image's bytes, decides its fragment (`routing`: the number of the
    routing of the job's model version in the core)."""
    if job.protocol == "oip":
        outputs = ",".join(f"{output.kind}:{output.k}" for output in job.oip_outputs)
    else:
        embedding = f"{int(job.embedding)}{'h' if job.embedding_fp16 else ''}"
        outputs = f"labels:{job.top_k if job.labels else 0},embedding:{embedding}"
    return f"{job.model}#{routing}\0{job.protocol}\0{outputs}\0".encode()


def image_keys(job: Job, routing: int = 0) -> list[bytes]:
    """Each image's key: the hash of what was asked, then of its bytes."""
    base = blake3.blake3(asked(job, routing))
    keys = []
    for image in buffers(job.images):
        h = base.copy()
        h.update(image)
        keys.append(h.digest(KEY_BYTES))
    return keys


def cacheable(job: Job) -> bool:
    return job.pixels is None and job.count > 0


@dataclass(eq=False)
class _Request:
    """A request under the cache: its images' fragments (or failures) as they come."""

    pending: Any  # the core's handle: `done` once answered (serve_app/core/serving.py _Pending)
    job: Job
    served: Served
    keys: list[bytes]
    slots: list[Fragment | Failure | None]
    waiting: int  # slots not filled yet
    parts: list[Part] = field(default_factory=list)
    timing: StageTiming = field(default_factory=StageTiming)  # of the last part answered
    whole: Answer | None = None  # the answer of a part that was the whole job, unchanged

    def fill(self, position: int, value: Fragment | Failure) -> None:
        if self.slots[position] is None:
            self.slots[position] = value
            self.waiting -= 1


@dataclass(eq=False)
class Part:
    """The images a request computes itself: what the core's dispatcher sends."""

    request: _Request
    job: Job  # the request's job with only these images, asking for fragments
    keys: tuple[bytes, ...]  # of each of its images
    settled: bool = False  # answered, or released

    @property
    def done(self) -> bool:
        return self.settled or self.request.pending.done


@dataclass(eq=False)
class _Flight:
    leader: Part
    waiters: list[tuple[_Request, int]]  # (request, position): the leader's own included


class CachedRequests:
    """The requests the core runs under the cache: their lookups, flights and answers."""

    def __init__(
        self,
        max_bytes: int,
        send: Callable[[Part], None],
        finish: Callable[[Any, Answer], None],
    ) -> None:
        """`send(part)`: queue a part for a call through the stages (answered through
        `answered`); `finish(pending, answer)`: answer a request (calls `release`)."""
        self.cache = ResultCache(max_bytes)
        self._send, self._finish = send, finish
        self._flights: dict[bytes, _Flight] = {}
        # Images by outcome at their request's arrival: hit, miss (sent), shared
        self.counts: collections.Counter[str] = collections.Counter()
        self._taken: collections.Counter[str] = collections.Counter()  # by the metrics
        self._evictions_taken = 0

    @property
    def flights(self) -> int:
        return len(self._flights)

    def take_counts(self) -> tuple[collections.Counter[str], int]:
        """Images by outcome, and evictions, since the last call (for the metrics)."""
        counts = self.counts - self._taken
        self._taken = self.counts.copy()
        evictions = self.cache.evictions - self._evictions_taken
        self._evictions_taken = self.cache.evictions
        return counts, evictions

    def start(self, pending: Any, served: Served, routing: int) -> _Request:
        """Answer `pending.job` from the cache and the flights where it can, send the rest
        (its first lookup counts in `counts`). Answers at once if nothing is left to wait
        for."""
        job = pending.job
        keys = image_keys(job, routing)
        request = _Request(pending, job, served, keys, [None] * job.count, job.count)
        hits, shared, sent = self._resolve(request, range(job.count))
        counts = self.counts
        counts["hit"] += hits
        counts["shared"] += shared
        counts["miss"] += sent
        if not request.waiting:
            self._complete(request)
        return request

    def _resolve(self, request: _Request, positions: Iterable[int]) -> tuple[int, int, int]:
        """Look `positions` up: fill the hits, join the flights, send the rest as one part.
        Returns (hits, shared, sent) images. Positions go in image order (a re-send lists
        them in another request's order): a part that holds every image, each once, is then
        the request itself, and its answer is the request's answer (`answered`)."""
        hits = shared = 0
        lead: dict[bytes, list[int]] = {}
        for position in sorted(positions):
            key = request.keys[position]
            fragment = self.cache.get(key)
            if fragment is not None:
                request.fill(position, fragment)
                hits += 1
            elif key in self._flights:
                self._flights[key].waiters.append((request, position))
                shared += 1
            elif key in lead:  # the same image twice in one request
                lead[key].append(position)
                shared += 1
            else:
                lead[key] = [position]
        if lead:
            images = pick(request.job.images, [mine[0] for mine in lead.values()])
            job = dataclasses.replace(request.job, images=images, count=len(images), fragments=True)
            part = Part(request, job, tuple(lead))
            for key, mine in lead.items():
                self._flights[key] = _Flight(part, [(request, p) for p in mine])
            request.parts.append(part)
            self._send(part)
        return hits, shared, len(lead)

    def answered(self, part: Part, answer: Answer) -> None:
        """The stages' answer to `part`: fill its waiters and the cache, answer whoever has
        every image now; waiters of an image that failed look it up again."""
        if part.done:  # released: its request was answered (say, by its deadline) meanwhile
            return
        request = part.request
        if not answer.fragments:  # the part failed as a whole: so does its request, whose
            failure = Failure(answer.code, answer.message)  # release frees the waiters
            self._finish(request.pending, failed(request.job, failure, answer.timing))
            return
        part.settled = True
        request.timing = answer.timing
        if part.job.count == request.job.count:  # every image, each once: the answer itself
            request.whole = dataclasses.replace(answer, fragments=())
        touched: dict[_Request, None] = {request: None}
        again: dict[_Request, list[int]] = {}
        for key, fragment in zip(part.keys, answer.fragments, strict=True):
            flight = self._flights.pop(key)
            failure = isinstance(fragment, Failure)
            if not failure:
                self.cache.put(key, fragment)
            for waiter, position in flight.waiters:
                if waiter is request or not failure:  # its own failure stays its answer
                    waiter.fill(position, fragment)
                    touched[waiter] = None
                else:
                    again.setdefault(waiter, []).append(position)
        for waiter, positions in again.items():
            if not waiter.pending.done:
                self._resolve(waiter, positions)
                touched[waiter] = None
        for waiter in touched:
            if not waiter.waiting and not waiter.pending.done:
                self._complete(waiter)

    def release(self, request: _Request) -> None:
        """`request` is answered or abandoned: the images it was computing for others are
        looked up again by those still waiting, who send them themselves if need be."""
        again: dict[_Request, list[int]] = {}
        for part in request.parts:
            if part.settled:
                continue
            part.settled = True
            for key in part.keys:
                flight = self._flights.pop(key)
                for waiter, position in flight.waiters:
                    if waiter is not request:
                        again.setdefault(waiter, []).append(position)
        request.parts.clear()
        for waiter, positions in again.items():
            if not waiter.pending.done:
                self._resolve(waiter, positions)
                if not waiter.waiting:
                    self._complete(waiter)

    def _complete(self, request: _Request) -> None:
        """Every image of `request` is in: its answer, assembled in image order."""
        answer = request.whole
        if answer is None:
            job, timing = request.job, request.timing
            if job.protocol == "oip":
                served = request.served
                engine = served.engine
                widths = oip_widths(job.oip_outputs, engine.num_classes, engine.embedding_dim)
                answer = oip_answer(job, served.name, served.version, widths, request.slots, timing)
            else:
                answer = v1_answer(job, request.slots, timing)
        self._finish(request.pending, answer)
