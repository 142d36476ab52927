import pytest

from piecewise import CompilationConfig, CompileRange, ConfigError


def test_defaults_are_valid_and_frozen():
    c = CompilationConfig()
    assert c.mode == "piecewise" and c.backend == "inductor"
    with pytest.raises(Exception):
        c.mode = "full"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"mode": "partial"}, "mode"),
        ({"cudagraph_mode": "sometimes"}, "cudagraph_mode"),
        ({"max_num_tokens": 0}, "max_num_tokens"),
        ({"compile_sizes": [0]}, "compile_sizes"),
        ({"compile_sizes": [600], "max_num_tokens": 512}, "max_num_tokens"),
        ({"compile_ranges": [256, 16]}, "compile_ranges"),
        ({"compile_ranges": [1024]}, "max_num_tokens"),
        ({"splitting_ops": "ns::op"}, "splitting_ops"),
        ({"tag": "a/b"}, "tag"),
        ({"compile_sizes": 8}, "compile_sizes"),
    ],
)
def test_invalid_field_names_field_and_remedy(kwargs, field):
    with pytest.raises(ConfigError) as e:
        CompilationConfig(**kwargs)
    assert field in str(e.value)


def test_ranges_cover_one_to_max():
    c = CompilationConfig(compile_ranges=[16, 256], max_num_tokens=512)
    assert c.ranges() == (CompileRange(1, 16), CompileRange(17, 256), CompileRange(257, 512))
    assert CompilationConfig(compile_ranges=[512], max_num_tokens=512).ranges() == (CompileRange(1, 512),)
    assert CompilationConfig().ranges() == ()


def test_sizes_sorted_and_deduplicated():
    assert CompilationConfig(compile_sizes=[8, 1, 8]).compile_sizes == (1, 8)


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ConfigError, match="max_tokens"):
        CompilationConfig.from_dict({"max_tokens": 3})


def test_from_env():
    env = {"PIECEWISE_CONFIG": '{"compile_sizes": [4]}', "PIECEWISE_BACKEND": "eager", "PIECEWISE_MAX_NUM_TOKENS": "64"}
    c = CompilationConfig.from_env(env)
    assert (c.backend, c.max_num_tokens, c.compile_sizes) == ("eager", 64, (4,))
    with pytest.raises(ConfigError, match="PIECEWISE_MAX_NUM_TOKENS"):
        CompilationConfig.from_env({"PIECEWISE_MAX_NUM_TOKENS": "many"})
    with pytest.raises(ConfigError, match="PIECEWISE_CONFIG"):
        CompilationConfig.from_env({"PIECEWISE_CONFIG": "{"})
    with pytest.raises(ConfigError, match="JSON list"):
        CompilationConfig.from_env({"PIECEWISE_CONFIG": "[1]"})


def test_code_factors_normalise_split_op_spellings():
    a = CompilationConfig(splitting_ops=["ns::op", "other.op.default"]).code_factors()
    b = CompilationConfig(splitting_ops=["other::op", "ns.op"]).code_factors()
    assert a == b
    assert "cache_dir" not in a and "tag" not in a


def test_an_unknown_field_names_it_and_the_close_matches():
    with pytest.raises(ConfigError) as e:
        CompilationConfig(max_num_token=8)
    assert "unknown field 'max_num_token'; did you mean 'max_num_tokens'" in str(e.value)  # the closest first
    with pytest.raises(ConfigError) as e:
        CompilationConfig(backnd="eager", compile_size=[4])
    msg = str(e.value)
    assert "'backnd'; did you mean 'backend'?" in msg and "'compile_size'; did you mean 'compile_sizes'" in msg


def test_an_unknown_field_without_a_close_match_lists_the_fields():
    with pytest.raises(ConfigError) as e:
        CompilationConfig(backend="eager", zzz_option=1)
    msg = str(e.value)
    assert "unknown field 'zzz_option'" in msg and "did you mean" not in msg
    assert "max_num_tokens" in msg and "compile_ranges" in msg


def test_unknown_fields_are_config_errors_on_every_path():
    base = CompilationConfig(backend="eager")
    with pytest.raises(ConfigError, match="did you mean 'compile_ranges'"):
        base.replace(compile_range=[4])
    with pytest.raises(ConfigError, match="did you mean 'max_num_tokens'"):
        CompilationConfig.from_dict({"max_tokens": 3})
    with pytest.raises(ConfigError, match="did you mean 'cudagraph_mode'"):
        CompilationConfig.from_env({"PIECEWISE_CONFIG": '{"cudagraph_mod": "none"}'})
    # still a ValueError (ConfigError's base), and valid keywords still work, positionally too
    with pytest.raises(ValueError):
        CompilationConfig(max_num_token=8)
    assert CompilationConfig("full", "eager").mode == "full"
    assert base.replace(max_num_tokens=8).max_num_tokens == 8


def test_the_constructor_keeps_its_signature():
    import inspect

    params = inspect.signature(CompilationConfig).parameters
    assert "max_num_tokens" in params and params["backend"].default == "inductor"
