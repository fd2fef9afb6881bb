"""The trainer's side of ``treepack serve``: micro-batches over HTTP as the PyTorch loader's tensors, acknowledged
after each optimizer step (standard library HTTP; torch only to build the tensors).

    >>> from treepack.client import FeedClient
    >>> feed = FeedClient(url, rank=0, dp=1, token=None, wait=1, stop_when_idle=True)   # url: "http://127.0.0.1:8400"
    >>> for mb in feed:                      # waits for the next micro-batch of this rank
    ...     print(mb.entry["groups"], mb.batch.num_sequences)   # mb.batch: a PackedBatch; mb.entry: its manifest entry
    ...     print(mb.ack()["step_done"])     # after the step: never handed out again
    ['0'] 2
    True

A micro-batch not acknowledged within the service's lease (``--lease``) is handed out again, to this rank, so a
trainer that dies mid-step loses nothing. Micro-batches packed with a step plan (``--prefix-reuse``) go out as a
run: a rank's micro-batches of one step in plan order, all to the one client (``client``, a random id per
``FeedClient`` unless given) that took the first; after a lease runs out the run starts over from its first
unacknowledged micro-batch, so a replacement trainer gets the plan from its start, not a micro-batch whose cached
prefix only the dead trainer held. Acknowledge a rank's micro-batches of a step together, after the optimizer step.
``entry`` carries ``id``, ``feed_step``, ``rank``, ``groups``, ``policy_version``, ``trainer_version`` and
``staleness`` (trainer steps between the policy that generated the rollouts and now) besides the packer's fields.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .microbatch import TreepackError


@dataclass
class FeedMicroBatch:
    """One micro-batch handed out by the trainer feed: its ``id``, its manifest ``entry`` (rank, step, ...), the
    ``batch`` as a treepack.torch.PackedBatch, and ``ack()`` to acknowledge it."""

    id: str
    entry: dict[str, Any]
    batch: Any  # treepack.torch.PackedBatch
    client: FeedClient

    def ack(self) -> dict[str, Any]:
        """Acknowledges this micro-batch (call after the optimizer step that used it)."""
        return self.client.ack(self.id)


class FeedClient:
    """Iterates the micro-batches of one rank. ``wait``: seconds each request long-polls; ``stop_when_idle``: end
    the iteration when a poll comes back empty instead of polling again (the producers are done); ``client``: this
    trainer process's id for the service (a step plan's micro-batches go to one client in order), random if None."""

    def __init__(
        self,
        url: str,
        rank: int = 0,
        dp: int | None = None,
        token: str | None = None,
        wait: float = 30.0,
        stop_when_idle: bool = False,
        device: Any = None,
        pin_memory: bool = False,
        timeout: float = 60.0,
        client: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.client = uuid.uuid4().hex if client is None else client
        self.rank = rank
        self.dp = dp
        self.token = token
        self.wait = wait
        self.stop_when_idle = stop_when_idle
        self.device = device
        self.pin_memory = pin_memory
        self.timeout = timeout

    def _request(self, method: str, path: str, timeout: float, retries: int = 0) -> Any:
        """``retries``: attempts after the first when the service did not answer or answered 502/503/504 (only for
        requests that mean the same when repeated)."""
        req = urllib.request.Request(self.url + path, method=method, data=b"{}" if method == "POST" else None)
        if method == "POST":
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", "Bearer " + self.token)
        attempt = 0
        while True:
            try:
                return urllib.request.urlopen(req, timeout=timeout)
            except urllib.error.HTTPError as e:
                if attempt < retries and e.code in (502, 503, 504):
                    time.sleep(min(8.0, 0.25 * 2**attempt))
                    attempt += 1
                    continue
                try:
                    message = json.loads(e.read())["error"]["message"]
                except Exception:
                    message = e.reason
                raise TreepackError("E_IO", f"{method} {path}: HTTP {e.code}: {message}") from None
            except (urllib.error.URLError, OSError) as e:
                if attempt < retries:
                    time.sleep(min(8.0, 0.25 * 2**attempt))
                    attempt += 1
                    continue
                # down, restarting, or unreachable: the same error type as a refusal, saying which service
                reason = getattr(e, "reason", e)
                raise TreepackError(
                    "E_IO",
                    f"{method} {self.url}{path}: treepack serve did not answer ({reason}); "
                    "a micro-batch handed out and not acknowledged is handed out again after the lease",
                ) from None

    def next(self) -> FeedMicroBatch | None:
        """The next micro-batch of this rank, or None when none came within ``wait`` seconds."""
        from .torch import load_microbatch  # torch is needed only here

        query = f"/v1/batches/next?rank={self.rank}&wait={self.wait:g}&client={urllib.parse.quote(self.client)}" + (
            f"&dp={self.dp}" if self.dp is not None else ""
        )
        with self._request("GET", query, self.timeout + self.wait) as res:
            if res.status == 204:
                return None
            entry = json.loads(res.headers["x-treepack-entry"])
            body = res.read()
        batch = load_microbatch(body, device=self.device, pin_memory=self.pin_memory)
        return FeedMicroBatch(id=entry["id"], entry=entry, batch=batch, client=self)

    def ack(self, id: str, retries: int = 5) -> dict[str, Any]:
        """Acknowledges micro-batch ``id`` (POST /v1/batches/{id}/ack): ``{id, step, step_done, trainer_version,
        repeated}``. Retried up to ``retries`` times (backing off 0.25 s to 8 s) when the service does not answer or
        answers 502/503/504: an acknowledgement repeated after a lost answer is answered, ``repeated`` true."""
        with self._request("POST", f"/v1/batches/{id}/ack", self.timeout, retries) as res:
            answer = json.loads(res.read())
        if not isinstance(answer, dict):
            raise TreepackError("E_INPUT", f"the service answered an ack with {type(answer).__name__}, expected an object", field="ack")
        return answer

    def __iter__(self) -> Iterator[FeedMicroBatch]:
        while True:
            mb = self.next()
            if mb is None:
                if self.stop_when_idle:
                    return
                continue
            yield mb
