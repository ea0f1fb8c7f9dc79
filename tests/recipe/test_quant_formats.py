"""quant.format: one record per format (megatron_kd/quant_formats/), read by the checks, the quantizer, the
planner and the export; `plan` and `launch --dry-run` refuse what `train` refuses, from the same check."""
import importlib.util
from pathlib import Path

import pytest

from megatron_kd import quant_formats
from megatron_kd.recipe.compose import compose
from megatron_kd.recipe.schema import RecipeError, to_recipe

ROOT = Path(__file__).resolve().parents[2]


def _train_refusal(fmt: str) -> str:
    """The sentence `megatron-kd train` refuses quant.format=fmt with (its recipe check)."""
    from megatron_kd.recipe.checks import check_recipe
    r = to_recipe(compose("tiny_cpu", [f"quant.format={fmt}"]))
    with pytest.raises(RecipeError) as e:
        check_recipe(r, 1, False)
    return str(e.value)


@pytest.mark.parametrize("fmt", ["fp9", "int4-awq"])
def test_plan_refuses_an_unknown_format_as_train_does(capsys, fmt):
    from megatron_kd.cli.plan import main
    refusal = _train_refusal(fmt)
    assert "quant.format=" in refusal and "int4_awq" in refusal
    assert main(["llama31_8b_to_3b_32k_1xh200", "kd.cache=/tmp/x", f"quant.format={fmt}"]) == 2
    assert capsys.readouterr().err.strip() == f"megatron-kd plan: {refusal}"


@pytest.mark.parametrize("fmt", ["fp9", "int4-awq"])
def test_launch_dry_run_refuses_an_unknown_format_as_train_does(monkeypatch, fmt):
    from megatron_kd.cli import launch
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        launch.main(["--dry-run", "llama31_8b_to_3b_32k_1xh200", "kd.cache=/c", f"quant.format={fmt}"])
    assert str(e.value) == f"megatron-kd launch: {_train_refusal(fmt)}"


def test_plan_and_launch_dry_run_still_take_a_format_for_a_gpu(monkeypatch, capsys):
    """nvfp4 runs on a GPU only: refused by a CPU train here, planned and launched for the GPU machine."""
    from megatron_kd.cli import launch
    from megatron_kd.cli.plan import main
    assert "needs a CUDA GPU" in _train_refusal("nvfp4")
    assert main(["llama31_8b_to_3b_32k_1xh200", "kd.cache=/tmp/x", "quant.format=nvfp4"]) == 0
    monkeypatch.chdir(ROOT)
    assert launch.main(["--dry-run", "llama31_8b_to_3b_32k_1xh200", "kd.cache=/c", "quant.format=nvfp4"]) == 0


def test_the_planner_and_the_export_read_the_records():
    from megatron_kd.export import compressed
    from megatron_kd.plan.memory import quantizer_bytes
    for name, f in quant_formats.FORMATS.items():
        assert quantizer_bytes(name, [(256, 64, 3)]) == 4 * 3 * f.buffer_floats(256, 64)
        assert compressed.supported(name) == (f.export is not None)
    assert quant_formats.get("w4a16_awq") is quant_formats.get("int4_awq")


@pytest.mark.skipif(importlib.util.find_spec("modelopt") is None, reason="needs NVIDIA ModelOpt")
def test_every_format_names_a_modelopt_config():
    from megatron_kd.models.quant import quant_config
    for name, f in quant_formats.FORMATS.items():
        if f.modelopt_config is not None:
            assert isinstance(quant_config(name), dict)


def test_each_file_of_the_formats_folder_is_one_registered_format():
    """A format is a file in quant_formats/ and its line in REGISTERED (its aliases are the record's)."""
    files = {p.stem for p in Path(quant_formats.__file__).parent.glob("*.py")} - {"__init__"}
    assert files == set(quant_formats.REGISTERED)
    assert list(dict.fromkeys(f.name for f in quant_formats.FORMATS.values())) == list(quant_formats.REGISTERED)
