"""HTTP: the one seam between the pipeline and the network, and the byte budget that
bounds the answer bodies in flight.

Modules (all private; the public names come from :mod:`opd_stream`, the seam's types
from here too):

* ``_transports``: the :class:`~opd_stream.Transport` protocol (``send``), its
:class:`~opd_stream.Request` and :class:`~opd_stream.Response`, the aiohttp and mock transports
* ``_httpx``: a transport on httpx (asyncio and trio)
* ``_budget``: the stream's memory budget for answer bodies (:class:`~opd_stream.BudgetLease`)
* ``_legacy``: a transport written for the old ``post`` / ``get``, wrapped for one release
"""

from ._budget import BudgetLease
from ._transports import AiohttpTransport, MockTransport, Request, Response, Transport

__all__ = ("AiohttpTransport", "BudgetLease", "MockTransport", "Request", "Response", "Transport")
