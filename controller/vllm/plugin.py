"""vLLM entry point (``vllm.general_plugins``: ``speccontrol = controller.vllm.plugin:register``).

vLLM calls ``register`` in every process it starts (API server, engine core, workers). It does
nothing unless the plugin is enabled (``SPECCONTROL_PLUGIN=1`` or ``VLLM_PLUGINS`` naming
``speccontrol``); then it validates the settings and patches the V1 scheduler class. Only the
engine-core process builds a scheduler, so only it connects to the sidecar.
"""

from __future__ import annotations

import logging
import os

from controller.vllm.settings import PluginSettings, SettingsError, enabled

log = logging.getLogger("speccontrol.vllm")


def register() -> None:
    env = os.environ
    if not enabled(env):
        return
    try:
        settings = PluginSettings.from_env(env)
    except SettingsError as e:
        log.error("speccontrol: plugin not started: %s", e)
        return
    from controller.vllm.engine_hooks import install

    install(settings)
