"""docs/config.md is `zerojax.cli.config_reference`'s output, and it lists every key of every config section."""

from __future__ import annotations

import pathlib
import re
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from zerojax.cli.config import Config
from zerojax.cli.config_reference import reference, section_text, type_name

ROOT = pathlib.Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "config.md"
REGENERATE = "python3 -m zerojax.cli.config_reference > docs/config.md"


def _config_keys() -> set[str]:
    keys = set()
    for name, field in Config.model_fields.items():
        section = field.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            keys |= {f"{name}.{key}" for key in section.model_fields}
        else:
            keys.add(name)
    return keys


def _documented_keys(text: str) -> list[str]:
    return re.findall(r"^\| `([\w.]+)` \|", text, flags=re.M)


def test_docs_config_md_is_the_generated_reference():
    assert DOC.read_text(encoding="utf-8") == reference(), f"docs/config.md is stale: run `{REGENERATE}`"


def test_every_field_of_every_section_is_listed_once():
    documented = _documented_keys(DOC.read_text(encoding="utf-8"))
    assert len(documented) == len(set(documented)), documented
    assert set(documented) == _config_keys()
    for name, field in Config.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            assert f"## `{name}`" in DOC.read_text(encoding="utf-8")


class _Sample(BaseModel):
    # What the sample section holds.
    count: Annotated[int, Field(ge=1)] = 2  # how many
    ratio: Annotated[float, Field(gt=0, lt=1)] | None = None
    mode: Literal["a", "b"] = Field("a", description="the mode")  # not this comment
    names: list[str] = Field(default_factory=list)
    flag: bool = True


def test_a_section_lists_type_bounds_default_and_description():
    text = section_text("sample", _Sample, list(_Sample.model_fields))
    assert text.startswith("## `sample`\n\nWhat the sample section holds.\n")
    rows = dict(zip(_documented_keys(text), text.splitlines()[-5:]))
    assert rows["sample.count"] == "| `sample.count` | int (>= 1) | `2` | how many |"
    assert rows["sample.ratio"] == "| `sample.ratio` | float (> 0, < 1) or null | `null` |  |"
    assert rows["sample.mode"] == '| `sample.mode` | "a" or "b" | `a` | the mode |'
    assert rows["sample.names"] == "| `sample.names` | list of str | `[]` |  |"
    assert rows["sample.flag"] == "| `sample.flag` | bool | `true` |  |"


def test_type_names_read_nested_annotations():
    assert type_name(Annotated[int, Field(ge=0)] | None) == "int (>= 0) or null"
    assert type_name(dict) == "dict"
