"""`zerojax.engines`: the registry names options only, and refuses an option an engine lacks."""

import dataclasses

import pytest

from zerojax.engines import EngineOptions, get_engine, names
from zerojax.errors import UserError


def test_each_engine_supports_only_engine_options():
    fields = {f.name for f in dataclasses.fields(EngineOptions)}
    assert all(get_engine(n).supports <= fields for n in names())


def test_an_option_the_engine_lacks_or_does_not_know_is_one_sentence():
    with pytest.raises(UserError, match="the gspmd engine does not support the option quantize_weights='int8'"):
        get_engine("gspmd").check(EngineOptions(quantize_weights="int8"))
    with pytest.raises(UserError, match="unknown engine option 'prefetchh'"):
        EngineOptions.of({"prefetchh": True})
