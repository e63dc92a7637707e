"""TRL 1.16.0's own teacher client and server-teacher trainer, loaded from the source that
``scripts/dev.sh setup`` unpacks from TRL's wheel into ``.cache/trl/src`` (never installed,
never imported as the ``trl`` package), for the tests and ``bench/trl_teacher.py``. Works
from a source checkout only.

* :func:`trl_client`: a ``VLLMClient`` loaded by path with stubs for the imports not
  installed here, built without its constructor (which needs vLLM): ``VLLMClient.__new__``
  plus the attributes ``get_sequence_logprobs`` reads. Its method runs as TRL ships it.
* :func:`load_server_distillation_trainer`: TRL's ``ServerDistillationTrainer`` module (its
  teacher-server loss path), with stubs for its base class and configuration.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

__all__ = (
    "TRL_CLIENT",
    "TRL_SERVER_TRAINER",
    "load_server_distillation_trainer",
    "load_trl_client_module",
    "trl_client",
)

ROOT = Path(__file__).resolve().parents[2]  # the checkout (opd_stream/testing/ is two down)
TRL_CLIENT = ROOT / ".cache" / "trl" / "src" / "trl" / "generation" / "vllm_client.py"
"""TRL 1.16.0's client, as the set-up step (``scripts/dev.sh setup``) extracts it."""

TRL_SERVER_TRAINER = (
    TRL_CLIENT.parents[1]
    / "experimental"
    / "server_distillation"
    / "server_distillation_trainer.py"
)
"""TRL 1.16.0's ``ServerDistillationTrainer`` (its teacher-server loss path)."""

_MODULES: dict[str, types.ModuleType] = {}


def _stub(name: str, package: bool = False, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    if package:
        mod.__path__ = []
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def _get_json_schema(func: Any) -> dict[str, Any]:
    raise NotImplementedError("transformers is not installed (stub)")


def _load(name: str, path: Path, stubs: dict[str, types.ModuleType]) -> types.ModuleType:
    """``path`` executed as module ``name`` (once) with ``stubs`` in ``sys.modules`` while
    it runs (removed afterwards, with the module itself)."""
    if name in _MODULES:
        return _MODULES[name]
    if not path.is_file():
        raise FileNotFoundError(f"{path} (run scripts/dev.sh setup)")
    saved = {key: sys.modules.get(key) for key in [*stubs, name]}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        for key, value in saved.items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value
    _MODULES[name] = module
    return module


def load_trl_client_module() -> types.ModuleType:
    """TRL's ``trl/generation/vllm_client.py`` as a module (loaded once).

    Stub modules stand in, while the file is executed, for ``trl``, ``trl.generation``,
    ``trl.import_utils`` (requests available, vLLM not) and ``transformers.utils``; they
    are removed from ``sys.modules`` afterwards. ``torch`` and ``requests`` are the real ones.
    """
    stubs = {
        "trl": _stub("trl", package=True),
        "trl.generation": _stub("trl.generation", package=True),
        "trl.import_utils": _stub(
            "trl.import_utils",
            is_requests_available=lambda: True,
            is_vllm_available=lambda min_version=None: False,
        ),
        "transformers": _stub("transformers", package=True),
        "transformers.utils": _stub("transformers.utils", get_json_schema=_get_json_schema),
    }
    return _load("trl.generation.vllm_client", TRL_CLIENT, stubs)


class _TrainerBase:
    """Stands in for TRL's ``DistillationTrainer`` (transformers' ``Trainer``): only the
    server path's own methods are used."""


def load_server_distillation_trainer() -> types.ModuleType:
    """TRL's ``server_distillation_trainer.py`` as a module (loaded once), with stubs for
    its base class (``DistillationTrainer``), its configuration class and
    ``profiling_decorator`` (the identity); its loss functions and methods run as TRL
    ships them."""
    pkg = "trl.experimental.server_distillation"
    stubs = {
        "trl": _stub("trl", package=True),
        "trl.extras": _stub("trl.extras", package=True),
        "trl.extras.profiling": _stub("trl.extras.profiling", profiling_decorator=lambda f: f),
        "trl.trainer": _stub("trl.trainer", package=True),
        "trl.trainer.distillation_trainer": _stub(
            "trl.trainer.distillation_trainer", DistillationTrainer=_TrainerBase
        ),
        "trl.experimental": _stub("trl.experimental", package=True),
        pkg: _stub(pkg, package=True),
        f"{pkg}.server_distillation_config": _stub(
            f"{pkg}.server_distillation_config", ServerDistillationConfig=object
        ),
    }
    return _load(f"{pkg}.server_distillation_trainer", TRL_SERVER_TRAINER, stubs)


def trl_client(base_url: str) -> Any:
    """TRL's ``VLLMClient`` for ``base_url``, without its constructor's vLLM check: a
    ``requests.Session``, ``base_url`` and ``model`` (the server's ``/v1/models``) set as the
    constructor sets them."""
    import requests

    cls = load_trl_client_module().VLLMClient
    client = cls.__new__(cls)
    client.session = requests.Session()
    client.base_url = base_url.rstrip("/")
    # as the constructor does: the served model's name from GET /v1/models (TRL's _get)
    client.model = client._get(f"{client.base_url}/v1/models")["data"][0]["id"]
    return client
