"""What the plugin can run in a given engine: the per-request composite drafter, or only the K table.

Decided from the engine's ``VllmConfig`` alone, so the engine core (which reports it in
``Hello.plugin_mode``) and the worker processes (which install the worker-side merge only when the
engine core will ask for it) reach the same answer. Plain Python: no vLLM import.
"""

from __future__ import annotations

from typing import Any

from controller.vllm.settings import PluginSettings
from policies.arms import Method

#: Hello.plugin_mode values: composite drafting on, or why only the K table is controlled.
PER_REQUEST_COMPOSITE = "per-request composite"
K_TABLE_ONLY = "K table only"
#: Added to the mode when P-EAGLE's table cannot take 0 < K < max (vLLM left unpatched).
P_EAGLE_MAX_K_ONLY = "P-EAGLE table K in {0, max} only"
#: SchedulerOutput attribute (async scheduling): the request ids whose next draft, proposed in the
#: worker in this step, is n-gram's. Pickled to the worker with the output.
NGRAM_ROWS_ATTR = "speccontrol_ngram_rows"
#: SchedulerOutput attribute (async scheduling, V1 runner): the K the configured drafter (EAGLE-3,
#: P-EAGLE) proposes at in the worker in this step, at most ``num_spec_tokens_to_schedule`` (the
#: placeholders' width, which n-gram rows may fill): the largest K planned for its rows, at least 1,
#: raised to a K vLLM prepared (``Controls.drafter_k``). Absent: the full width.
EAGLE_K_ATTR = "speccontrol_eagle_k"


def configured_method(spec: Any) -> Method | None:
    """The controller's name for the engine's drafting method, None when the plugin cannot drive it."""
    m = str(getattr(spec, "method", ""))
    if m in ("eagle", "eagle3"):
        return Method.P_EAGLE if getattr(spec, "parallel_drafting", False) else Method.EAGLE3
    if m == "ngram":
        return Method.NGRAM
    return None


def is_async(vllm_config: Any) -> bool:
    return bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))


def k_table_only_reason(*, settings: PluginSettings, method: Method, vllm_config: Any) -> str | None:
    """Why this engine cannot run the composite drafter; None: it can (under async scheduling, with
    the worker-side merge, whose symbols the caller checks)."""
    vc = vllm_config
    if not settings.composite:
        return "switched off (SPECCONTROL_COMPOSITE=0)"
    if method is Method.NGRAM:
        return "the engine drafts with n-gram only"
    if str(getattr(vc.speculative_config, "draft_sample_method", "greedy")) != "greedy":
        return "probabilistic draft sampling (EAGLE's draft probabilities would pair with n-gram tokens)"
    if bool(getattr(vc, "use_v2_model_runner", False)):
        if not settings.v2_composite:
            return (
                "the V2 model runner (VLLM_USE_V2_MODEL_RUNNER=0 selects V1; SPECCONTROL_V2_COMPOSITE=1 "
                "enables the experimental V2 merge)"
            )
        if not is_async(vc):
            return "the V2 model runner with synchronous scheduling (the V2 merge needs async scheduling)"
        if bool(getattr(vc.speculative_config, "enable_adaptive_verification", False)):
            # The V2 runner records EAGLE's draft confidences for every row (record_confidences):
            # n-gram rows would be verified, and cut, by the confidences of drafts they do not carry.
            return (
                "the V2 model runner with adaptive verification (EAGLE's confidences would cut n-gram rows)"
            )
    return None


def plugin_mode(reason: str | None, *, p_eagle_depths: str | None = None) -> str:
    """``Hello.plugin_mode`` for a ``k_table_only_reason``; ``p_eagle_depths``: why a P-EAGLE engine's
    table stays at K in {0, max} (the depth fix could not be installed), None when it need not."""
    mode = PER_REQUEST_COMPOSITE if reason is None else f"{K_TABLE_ONLY}: {reason}"
    return mode if p_eagle_depths is None else f"{mode}; {P_EAGLE_MAX_K_ONLY}: {p_eagle_depths}"
