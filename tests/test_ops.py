import pytest
import torch

import piecewise as pw
from piecewise.ops import normalize_op_name, registered_splitting_ops
from piecewise.models.toy import toy_attention


@pytest.mark.parametrize(
    "spelling",
    [
        "piecewise_models::toy_attention",
        "piecewise_models.toy_attention",
        "piecewise_models::toy_attention.default",
        "piecewise_models.toy_attention.default",
        "torch.ops.piecewise_models.toy_attention",
        torch.ops.piecewise_models.toy_attention,
        torch.ops.piecewise_models.toy_attention.default,
        toy_attention,
    ],
)
def test_every_spelling_normalises_to_one_name(spelling):
    assert normalize_op_name(spelling) == "piecewise_models::toy_attention"


def test_bad_names_raise_config_error():
    with pytest.raises(pw.ConfigError):
        normalize_op_name("attention")
    with pytest.raises(pw.ConfigError):
        normalize_op_name(3)
    with pytest.raises(pw.ConfigError):
        pw.splitting_op("no_namespace")


def test_decorator_registers_op_and_split_point():
    @pw.splitting_op("pw_test_ops::double", mutates_args=())
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @double.register_fake
    def _(x):
        return torch.empty_like(x)

    assert "pw_test_ops::double" in registered_splitting_ops()
    assert torch.equal(torch.ops.pw_test_ops.double(torch.ones(2)), torch.full((2,), 2.0))
