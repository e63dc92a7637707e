"""What each server URL supports, as detected from its answers, and the request forms
that follow from it (``id_scoring="auto"``, ``topk_wire="auto"``).

Detection is per endpoint and logged once (``capability_detected``), not per sample:

* ``per_position``: a per-position id request answered without
  ``input_token_ids_logprobs`` (the server ignored the field) -> blocked form;
* ``blocked_batch``: a blocked (batch) request answered 422, as sglang-router 0.3.2 does
  for a list ``logprob_start_len`` -> the blocks as independent requests ("blocks");
* ``b64_topk``: a b64 top-k request answered with nested JSON -> JSON top-k.
"""

from __future__ import annotations

from typing import Literal

from .._errors import CapabilityError, OPDStreamError, ServerHTTPError
from .._logging import get_logger
from ..wire._request import IdForm, ScoreRequest
from ._endpoints import Endpoints

__all__ = ("Capabilities", "Side")

log = get_logger()

Side = Literal["teacher", "student"]


class Capabilities:
    """The capability rules; what was detected is kept in each URL's
    :class:`~opd_stream.fleet._endpoints.Endpoint`."""

    def __init__(
        self,
        endpoints: Endpoints,
        *,
        id_scoring: IdForm | Literal["auto"],
        topk_wire: Literal["b64", "json", "auto"],
    ) -> None:
        # the two settings it obeys (``StreamConfig.id_scoring`` and ``.topk_wire``), where
        # ``auto`` lets each URL's answers decide
        self._id_scoring = id_scoring
        self._topk_wire = topk_wire
        self._endpoints = endpoints

    def id_form(self, url: str) -> IdForm:
        mode = self._id_scoring
        if mode != "auto":
            return mode
        ep = self._endpoints(url)
        if ep.per_position is not False:
            return "per-position"
        # sglang-router 0.3.2 rejects a batch with per-item logprob_start_len (HTTP 422):
        # the same blocks then go as independent single requests, which it forwards
        # (answers stay O(R k B); the flat union's grow as R^2).
        return "blocks" if ep.blocked_batch is False else "blocked"

    def topk_wire(self, url: str) -> Literal["b64", "json"]:
        wire = self._topk_wire
        if wire != "auto":
            return wire
        return "json" if self._endpoints(url).b64_topk is False else "b64"

    def note(self, url: str, side: Side, name: str, supported: bool) -> None:
        ep = self._endpoints(url)
        current = ep.per_position if name == "per_position" else ep.b64_topk
        if current is supported:
            return
        if name == "per_position":
            ep.per_position = supported
        else:
            ep.b64_topk = supported
        log.info("capability_detected", side=side, url=url, capability=name, supported=supported)

    def batch_rejected(self, side: Side, url: str, req: ScoreRequest, exc: OPDStreamError) -> bool:
        """True when ``auto`` id scoring should retry a rejected blocked request as blocks.

        A proxy in front of SGLang (sglang-router 0.3.2) answers 422 to a batch whose
        ``logprob_start_len`` is a list, which the blocked form sends; SGLang itself takes
        it. The endpoint then sends the blocks as independent requests (logged once).
        """
        if not (
            isinstance(exc, ServerHTTPError)
            and exc.status == 422
            and req.id_form == "blocked"
            and self._id_scoring == "auto"
        ):
            return False
        ep = self._endpoints(url)
        if ep.blocked_batch is False:
            return True  # detected by a concurrent request already: retry as blocks
        ep.blocked_batch = False
        log.info(
            "capability_detected",
            side=side,
            url=url,
            capability="blocked_batch",
            supported=False,
        )
        return True

    def fallback(self, side: Side, url: str, req: ScoreRequest, exc: CapabilityError) -> bool:
        """Record a missing capability; True when an ``auto`` setting can fall back."""
        if exc.capability == "per_position" and req.id_form == "per-position":
            self.note(url, side, "per_position", False)
            return self._id_scoring == "auto"
        if exc.capability == "b64_topk":
            self.note(url, side, "b64_topk", False)
            return self._topk_wire == "auto"
        return False
