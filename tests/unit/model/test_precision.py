"""precision.py: explicit choices pass through, `auto` follows the device's bf16 support, typos fail."""

import pytest

from draftsmith.core.model.precision import bf16_is_native, compute_dtype, train_precision


def test_explicit_choices_pass_through():
    assert compute_dtype("float32") == "float32" and compute_dtype("bfloat16") == "bfloat16"
    assert train_precision("fp32") == "fp32" and train_precision("bf16") == "bf16"


def test_auto_follows_the_cpu(monkeypatch):
    for native, dtype, precision in [(True, "bfloat16", "bf16"), (False, "float32", "fp32")]:
        monkeypatch.setattr("draftsmith.core.model.precision.bf16_is_native", lambda device=None, n=native: n)
        assert compute_dtype("auto", "cpu") == dtype
        assert train_precision("auto", "cpu") == precision


def test_auto_on_this_machine_matches_its_cpu_flags():
    expected = "bfloat16" if bf16_is_native("cpu") else "float32"
    assert compute_dtype("auto", "cpu") == expected


@pytest.mark.parametrize("call", [lambda: compute_dtype("float16"), lambda: train_precision("bfloat16")])
def test_unknown_values_are_named(call):
    with pytest.raises(ValueError, match="expected one of"):
        call()
