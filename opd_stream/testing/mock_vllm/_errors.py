"""vLLM's error answers: ``ErrorResponse`` = ``{"error": {"message", "type", "param", "code"}}``
(``vllm/entrypoints/serve/engine/protocol.py``), as ``create_error_response`` builds it."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ("SCALE_OUT_DISABLED", "VllmError", "error_body")

SCALE_OUT_DISABLED = (
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
)
"""The 403 message of ``/inference/v1/generate`` on a server started without
``--enable-scale-out`` (``vllm/entrypoints/scale_out/factories.py``)."""

_encoder = msgspec.json.Encoder()


def error_body(message: str, code: int, type_: str = "BadRequestError", param: Any = None) -> bytes:
    """vLLM's ``ErrorResponse`` JSON."""
    return _encoder.encode(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


class VllmError(Exception):
    """A request vLLM rejects: ``status`` and ``body`` are the HTTP answer.

    ``param`` is the ``VLLMValidationError``'s ``parameter`` (the field at fault) or None.
    """

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        param: str | None = None,
        type_: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type_ = type_ or {
            400: "BadRequestError",
            403: "PermissionDeniedError",
            404: "NotFoundError",
            429: "RateLimitError",
            500: "InternalServerError",
            503: "ServiceUnavailableError",
        }.get(status, "BadRequestError")

    @property
    def body(self) -> bytes:
        return error_body(self.message, self.status, self.type_, self.param)
