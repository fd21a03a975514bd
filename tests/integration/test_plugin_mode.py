"""Hello.plugin_mode through a real sidecar: the attach log line, the admin status and `controllerctl
engines` (text and --json) say which mode the engine's plugin runs."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path

import pytest

from controller.cli import main
from controller.config import SidecarConfig
from controller.server import SidecarServer as Sidecar
from controller.vllm.control import engine_info
from controller.vllm.link import SidecarLink
from controller.vllm.mode import plugin_mode
from controller.wire.convert import hello_from_engine_info
from policies.arms import Method

pytestmark = pytest.mark.integration

REASON = "the V2 model runner (VLLM_USE_V2_MODEL_RUNNER=0 selects V1)"


def test_plugin_mode_in_log_status_and_engines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cfg = SidecarConfig(
        engine_listen="127.0.0.1:0", admin_listen="127.0.0.1:0", metrics_listen="", state_dir=str(tmp_path)
    )
    sidecar = Sidecar(config=cfg)
    asyncio.run_coroutine_threadsafe(sidecar.start(), loop).result(20)
    links = []
    try:
        with caplog.at_level(logging.INFO):
            for eid, mode in (("composite", plugin_mode(None)), ("table", plugin_mode(REASON))):
                info = engine_info(
                    engine_id=eid, model="m", method=Method.EAGLE3, max_k=4, max_batch_size=8,
                    composite=mode == plugin_mode(None),
                )  # fmt: skip
                hello = hello_from_engine_info(info, engine_version="vllm 0.32.0", plugin_mode=mode)
                link = SidecarLink(target=sidecar.engine_target, hello=hello)
                link.start()
                links.append(link)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not all(link.stats().connected for link in links):
                time.sleep(0.05)
        assert all(link.stats().connected for link in links)
        assert "plugin mode: per-request composite" in caplog.text
        assert f"plugin mode: K table only: {REASON}" in caplog.text
        assert main(["--admin", sidecar.admin_target, "engines", "--json"]) == 0
        got = {e["engine_id"]: e["plugin_mode"] for e in json.loads(capsys.readouterr().out)["engines"]}
        assert got == {"composite": "per-request composite", "table": f"K table only: {REASON}"}
        assert main(["--admin", sidecar.admin_target, "engines"]) == 0
        text = capsys.readouterr().out
        assert "plugin mode" in text and "per-request composite" in text and "K table only: the V2" in text
    finally:
        for link in links:
            link.close()
        asyncio.run_coroutine_threadsafe(sidecar.stop(snapshot=False), loop).result(20)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
