"""scripts/check_vllm_api.py: the connector against vLLM's KV-connector interface, read from source
(the installed vLLM when there is one, a wheel named by KVCMAS_VLLM_WHEEL, and a forged base class)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import check_vllm_api  # noqa: E402

FORGED = """
from abc import ABC, abstractmethod
class KVConnectorBase_V1(ABC):
    def __init__(self, vllm_config, role, kv_cache_config): ...
    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs): ...
    @abstractmethod
    def register_kv_delivery(self, request, stream, deadline): ...
    def requires_piecewise_for_cudagraph(cls, extra_config): ...
    def build_connector_worker_meta(self): ...
    def update_connector_output(self, connector_output): ...
"""


def test_a_new_abstract_method_in_vllm_is_reported_missing(tmp_path):
    base = tmp_path / check_vllm_api.BASE
    base.parent.mkdir(parents=True)
    base.write_text(FORGED)
    problems, notes = check_vllm_api.check(tmp_path)
    assert problems == ["abstract method register_kv_delivery('self', 'request', 'stream', 'deadline') is not defined"]
    assert "ok: start_load_kv" in notes
    assert check_vllm_api.main([str(tmp_path / "nowhere")]) == 2


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here")
def test_the_connector_satisfies_the_installed_vllms_interface():
    path = Path(importlib.util.find_spec("vllm").origin).parent
    assert check_vllm_api.check(path)[0] == []


@pytest.mark.skipif(not os.environ.get("KVCMAS_VLLM_WHEEL"), reason="KVCMAS_VLLM_WHEEL names no vLLM wheel")
def test_the_connector_satisfies_a_given_vllm_wheels_interface():
    assert check_vllm_api.check(Path(os.environ["KVCMAS_VLLM_WHEEL"]))[0] == []
