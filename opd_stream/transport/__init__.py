"""HTTP: the one seam between the pipeline and the network, and the byte budget that
bounds the answer bodies in flight.

Modules (all private; the public names come from :mod:`opd_stream`):

* ``_transports``: the :class:`~opd_stream.Transport` protocol, :class:`~opd_stream.Response`, the
aiohttp and mock transports
* ``_httpx``: a transport on httpx (asyncio and trio)
* ``_budget``: the stream's memory budget for answer bodies
"""

__all__: tuple[str, ...] = ()
