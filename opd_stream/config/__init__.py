"""The settings: every knob declared once, read from keywords or ``OPD_STREAM_*``
variables, and checked once.

Modules (all private; the public names come from :mod:`opd_stream`):

* ``_settings``: :class:`~opd_stream.StreamConfig`, its environment reader and the settings table
* ``_fields``: what a field is (name, type, default, env variable, help) and what follows from it
* ``_rules``: the rules between fields, checked after each field on its own
* ``_secret``: :class:`~opd_stream.Secret`, the API key that never shows itself
* ``_device``: ``kl_device`` and ``decode_threads`` resolved to concrete values
"""

__all__: tuple[str, ...] = ()
