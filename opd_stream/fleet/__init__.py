"""Where each request goes: teacher names and URLs, ensembles, the replicas' health and
load, what each server supports, fleets discovered behind a gateway, and the probe.

Modules (all private; the public names come from :mod:`opd_stream`):

* ``_fleet``: :class:`Fleet`, every server of a stream and all known of them (built by the stream)
* ``_routing``: ``NAME=URL`` parsing, URL validation and each sample's teacher
* ``_ensemble``: weighted teacher ensembles: their members, weights and configuration form
* ``_endpoints``: the state of every server URL a stream talks to
* ``_records``: what ``stats()`` reports of each server URL and each gateway
* ``_balance``: which replica gets the next request (prefix locality, least outstanding)
* ``_capabilities``: what each URL supports, as learned from its answers
* ``_discovery``: workers listed by smg or sglang-router, kept current
* ``_engines``: each URL's engine (SGLang, vLLM scale-out, vLLM completions): set or detected
* ``_probe``: the probe's report: replicas that disagree with the rest
* ``_probe_requests``: the probe's cold and warm requests to every replica
"""

__all__: tuple[str, ...] = ()
