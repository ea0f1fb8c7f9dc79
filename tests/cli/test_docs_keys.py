"""recipes/README.md documents every schema key (train.optimizer and the lean_adam moments were missing)."""
import dataclasses
import re
from pathlib import Path

import pytest

from megatron_kd.recipe.schema import Recipe

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = [f.name for f in dataclasses.fields(Recipe) if f.name != "teacher"]  # teacher shares model's table


@pytest.mark.parametrize("section", SECTIONS)
def test_recipes_readme_lists_every_schema_key(section):
    text = (ROOT / "recipes" / "README.md").read_text()
    body = text.split(f"### `{section}`", 1)[1].split("\n### ", 1)[0]
    documented = set(re.findall(r"`([a-z_0-9]+)`", body))
    cls = next(f.default_factory for f in dataclasses.fields(Recipe) if f.name == section)
    missing = [f.name for f in dataclasses.fields(cls()) if f.name not in documented]
    assert not missing, f"recipes/README.md section {section} lacks {missing}"
