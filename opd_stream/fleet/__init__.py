"""Where each request goes: teacher names and URLs, ensembles, the replicas' health and
load, what each server supports, fleets discovered behind a gateway, and the probe.

Its modules, and what each holds: ``docs/internals.md``, "Module map".
"""

__all__: tuple[str, ...] = ()
