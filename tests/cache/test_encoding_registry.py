"""Cache encodings register themselves (cache/encoding/): get_encoding looks the name up, each encoding says what
it adds to a cache's settings, and the command line and Bridge's cache command take their encoding flags from the
registry; a new encoding registered in one place is offered everywhere."""
import numpy as np
import pytest

from megatron_kd.cache import encoding as enc
from megatron_kd.cache.encoding.fp32 import Fp32Encoding


def _build_flags(parser):
    build = parser._subparsers._group_actions[0].choices["build"]
    return {a.option_strings[0]: a for a in build._actions if a.option_strings}


@pytest.fixture
def parsers():
    from megatron_kd.bridge.cache import parser as bridge_parser
    from megatron_kd.cli.cache import parser as cli_parser
    return {"cli": cli_parser, "bridge": bridge_parser}


def test_the_commands_offer_what_the_registry_holds(parsers):
    for name, make in parsers.items():
        flags = _build_flags(make())
        assert tuple(flags["--encoding"].choices) == enc.ENCODINGS, name
        for key in enc.setting_keys():
            assert "--" + key.replace("_", "-") in flags, (name, key)


def test_each_encoding_writes_its_own_settings():
    from megatron_kd.cache.format import make_settings
    base = dict(vocab_size=50, temperature=1.0, seq_length=4, num_samples=2, teacher="t")
    assert "top_p" not in make_settings(encoding=enc.EncodingOptions("fp16", 4), **base)
    s = make_settings(encoding=enc.EncodingOptions.of("topp", 4, top_p=0.5), **base)
    assert (s["top_p"], s["min_k"]) == (0.5, 1)
    s = make_settings(encoding=enc.EncodingOptions.of("sampled", 3, samples=3), **base)
    assert (s["samples"], s["sample_seed"]) == (3, 0)
    assert enc.EncodingOptions.of("sampled", samples=3).forced_top_k() == 3
    assert enc.EncodingOptions.of("fp16", samples=3).forced_top_k() is None


def test_a_new_encoding_is_one_class_and_one_registration(monkeypatch, parsers):
    """A registered class is found by name, offered by both commands, and round-trips a sample."""
    monkeypatch.setattr(enc, "REGISTRY", dict(enc.REGISTRY))

    class Fp32Again(Fp32Encoding):
        name = "fp32_again"
    enc.register(Fp32Again)
    monkeypatch.setattr(enc, "ENCODINGS", tuple(enc.REGISTRY))
    e = enc.get_encoding("fp32_again", 50, 4, 3)
    assert isinstance(e, Fp32Again)
    ids = np.array([[1, 2, 3, 4]] * 3)
    logp = np.log(np.full((3, 4), 0.25, dtype=np.float32))
    back_ids, back_logp = e.decode(e.encode(ids, logp))
    np.testing.assert_array_equal(back_ids, ids)
    np.testing.assert_array_equal(back_logp, logp)
    for name, make in parsers.items():
        assert "fp32_again" in _build_flags(make())["--encoding"].choices, name


def test_each_file_of_the_encoding_folder_is_one_registered_encoding():
    """An encoding is a file in cache/encoding/ and its line in REGISTERED: a file left out of the tuple would be
    offered nowhere, a line without its file fails at import."""
    import pathlib
    files = {p.stem for p in pathlib.Path(enc.__file__).parent.glob("*.py")} - {"__init__", "base"}
    assert files == set(enc.REGISTERED)
    assert enc.ENCODINGS == tuple(enc.REGISTRY) == tuple(
        __import__(f"megatron_kd.cache.encoding.{m}", fromlist=["ENCODING"]).ENCODING.name for m in enc.REGISTERED)
