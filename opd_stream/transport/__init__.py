"""HTTP: the one seam between the pipeline and the network, and the byte budget that
bounds the answer bodies in flight.

Its modules, and what each holds: ``docs/internals.md``, "Module map".
"""

from ._budget import BudgetLease
from ._native import AsyncioTransport
from ._transports import AiohttpTransport, MockTransport, Request, Response, Transport

__all__ = (
    "AiohttpTransport",
    "AsyncioTransport",
    "BudgetLease",
    "MockTransport",
    "Request",
    "Response",
    "Transport",
)
