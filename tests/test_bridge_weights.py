"""model.hf_weights: real weights through Megatron-Bridge's AutoBridge, clear errors without it."""
import json
import sys
import types

import pytest

from megatron_kd.bridge import weights


def test_not_a_hf_dir_names_the_key(tmp_path):
    with pytest.raises(ValueError, match="model.hf_weights=.*no config.json"):
        weights.check_hf_dir(str(tmp_path), "model.hf_weights")


def test_without_bridge_the_error_names_the_fix(monkeypatch):
    monkeypatch.setattr("megatron_kd.bridge.bridge_available", lambda: False)
    with pytest.raises(ValueError, match="model.hf_weights needs Megatron-Bridge"):
        weights.require_bridge("model.hf_weights")


def test_load_goes_through_autobridge(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    calls = []

    class FakeAutoBridge:
        @classmethod
        def from_hf_pretrained(cls, path):
            calls.append(("from_hf_pretrained", path))
            return cls()

        def load_hf_weights(self, model, hf_path=None):
            calls.append(("load_hf_weights", list(model), hf_path))

    fake = types.ModuleType("megatron.bridge")
    fake.AutoBridge = FakeAutoBridge
    monkeypatch.setitem(sys.modules, "megatron.bridge", fake)
    monkeypatch.setattr("megatron_kd.bridge.bridge_available", lambda: True)
    chunks = ["chunk0", "chunk1"]
    weights.load_hf_weights(chunks, str(tmp_path))
    assert calls == [("from_hf_pretrained", str(tmp_path)), ("load_hf_weights", chunks, str(tmp_path))]
