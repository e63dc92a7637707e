"""The error answers of the mock SGLang server, in SGLang's shapes.

``/generate`` rejections are :class:`RequestError` (its ``kind`` picks the body shape);
:func:`error_response_body` is SGLang's ``ErrorResponse`` (HTTPException and validation
handlers, also the injected HTTP faults and the queue-full answer); :func:`validation_error`
words a pydantic validation failure as SGLang's FastAPI layer does.
"""

from __future__ import annotations

import msgspec

__all__ = ("RequestError", "error_response_body", "validation_error")

_encoder = msgspec.json.Encoder()


def error_response_body(message: str, status: int, type_: str | None = None) -> bytes:
    """SGLang's ``ErrorResponse`` shape (HTTPException / validation handlers)."""
    return _encoder.encode(
        {
            "object": "error",
            "message": message,
            "type": type_ if type_ is not None else str(status),
            "param": None,
            "code": status,
        }
    )


class RequestError(Exception):
    """A ``/generate`` request was rejected; ``status`` and ``body`` are the HTTP answer.

    ``kind`` is ``"validation"`` (ErrorResponse shape), ``"contract"`` (``{"error": str}``),
    ``"value"`` (``{"error": {"message": str}}``) or ``"crash"`` (500, ErrorResponse shape).
    ``in_stream`` (``"value"`` errors of a ``stream: true`` request) makes the answer an HTTP
    200 event stream carrying the error, as SGLang's streaming ``/generate`` does.
    """

    def __init__(self, kind: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.error_status = status
        self.in_stream = False

    @property
    def status(self) -> int:
        """The HTTP status of the answer (200 for an in-stream error)."""
        return 200 if self.in_stream else self.error_status

    @property
    def content_type(self) -> str:
        """The answer's content type."""
        return "text/event-stream" if self.in_stream else "application/json"

    @property
    def body(self) -> bytes:
        if self.in_stream:
            err = {
                "message": self.message,
                "type": "invalid_request_error",
                "code": self.error_status,
                "retryable": False,
            }
            return b"data: " + _encoder.encode({"error": err}) + b"\n\ndata: [DONE]\n\n"
        if self.kind == "contract":
            return _encoder.encode({"error": self.message})
        if self.kind == "value":
            return _encoder.encode({"error": {"message": self.message}})
        type_ = "Bad Request" if self.kind == "validation" else None
        return error_response_body(self.message, self.status, type_)


def validation_error(loc: str, msg: str, kind: str) -> RequestError:
    """A pydantic validation error of ``GenerateReqInput`` at ``loc`` (HTTP 400)."""
    detail = f"[{{'type': '{kind}', 'loc': ('body', {loc}), 'msg': '{msg}'}}]"
    return RequestError("validation", f"1 validation error for GenerateReqInput {detail}")
