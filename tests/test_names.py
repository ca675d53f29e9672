"""gradgen.names: a value's name as a str, or a model error naming where the unnamed value comes from."""

import onnx_ir as ir
import pytest

from gradgen.errors import ModelError
from gradgen.names import value_name, value_names


def test_named_values_give_their_names_in_order():
    values = [ir.Value(name="x"), ir.Value(name="y")]
    assert value_name(values[0]) == "x"
    assert value_names(values) == ["x", "y"]


def test_an_unnamed_output_names_its_producer():
    node = ir.node("Relu", [ir.Value(name="x")], name="act")
    with pytest.raises(ModelError, match=r"output 0 of Relu node 'act' has no name"):
        value_names([ir.Value(name="x"), node.outputs[0]])


def test_an_unnamed_value_without_producer_is_a_model_error():
    with pytest.raises(ModelError, match="a value with no producer has no name"):
        value_name(ir.Value(name=None))


def test_name_mismatch_lists_missing_then_unknown_names():
    from gradgen.names import name_mismatch

    assert name_mismatch(["a", "b"], {"b": 1, "a": 2}, "missing {}", "unknown {}") == ""
    assert name_mismatch(["a", "b", "c"], ["z", "b", "y"], "missing {}", "unknown {}") == "missing 'a', 'c'; unknown 'y', 'z'"
    assert name_mismatch(["a"], ["a", "x"], "no {}", "{} extra") == "'x' extra"
