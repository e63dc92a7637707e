"""Install :class:`~opd_stream.integrations.verl.TeacherManager` in a verl job.

Imported by verl only (it imports ``verl`` and ``ray``): select it with::

    actor_rollout_ref.rollout.agent.agent_loop_manager_class=\\
        opd_stream.integrations.verl_agent_loop.OPDStreamAgentLoopManager

:class:`OPDStreamAgentLoopManager` starts :class:`OPDStreamAgentLoopWorker` actors; each
builds verl's own state and swaps ``teacher_server_manager`` for a ``TeacherManager`` read
from verl's configuration and the worker's ``OPD_STREAM_*`` variables
(``OPD_STREAM_TEACHERS`` names the servers; set them in Ray's ``runtime_env``).
"""

from __future__ import annotations

from typing import Any

import ray  # type: ignore[import-not-found]
from verl.experimental.agent_loop.agent_loop import (  # type: ignore[import-not-found]
    AgentLoopManager,
    AgentLoopWorker,
)

from .verl import TeacherManager, verl_teacher_names

__all__ = ("OPDStreamAgentLoopManager", "OPDStreamAgentLoopWorker")


class OPDStreamAgentLoopWorker(AgentLoopWorker):  # type: ignore[misc]
    """verl's ``AgentLoopWorker`` whose teacher is opd_stream's :class:`TeacherManager`."""

    def __init__(
        self,
        config: Any,
        llm_client: Any,
        teacher_client: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        if teacher_client is None:
            teacher_client = dict.fromkeys(verl_teacher_names(config))
        super().__init__(config, llm_client, teacher_client, *args, **kwargs)
        if getattr(self, "distillation_enabled", False):
            self.teacher_server_manager = TeacherManager.from_verl_config(config)


class OPDStreamAgentLoopManager(AgentLoopManager):  # type: ignore[misc]
    """verl's ``AgentLoopManager`` starting :class:`OPDStreamAgentLoopWorker` actors."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.agent_loop_workers_class = ray.remote(OPDStreamAgentLoopWorker)
        super().__init__(*args, **kwargs)
