"""Registries that undo themselves, scoped tags, the forward context's one writer API and the
cache error hierarchy (issue 13: no test reaches into a module's private state)."""

from __future__ import annotations

import pytest

from piecewise.compilers import adaptor_names, get_adaptor, register_adaptor
from piecewise.compilers.eager import EagerAdaptor
from piecewise.config import CompilationConfig
from piecewise.errors import CacheError, ConfigError
from piecewise.forward_context import (ForwardContext, RuntimeMode, enter_forward, exit_forward, forward_context,
                                       set_forward_context)
from piecewise.graphs.platform import platform_names, register_platform, resolve_platform
from piecewise.registry import Registry
from piecewise.tags import scoped_tags, unique_tag


def test_a_registration_restores_what_the_name_held_before():
    reg: Registry[int] = Registry("number")
    first = reg.register("a", 1)
    with reg.register("a", 2):
        assert reg.get("a") == 2
    assert reg.get("a") == 1
    first.remove()
    assert "a" not in reg and reg.names() == ()
    first.remove()  # idempotent
    assert reg.names() == ()


def test_removing_an_older_registration_leaves_a_newer_one_in_place():
    reg: Registry[int] = Registry("number")
    old = reg.register("a", 1)
    reg.register("a", 2)
    old.remove()
    assert reg.get("a") == 2


def test_adaptor_and_platform_registrations_are_scoped():
    class Other(EagerAdaptor):
        name = "other-for-test"

    with register_adaptor("other-for-test", Other):
        assert "other-for-test" in adaptor_names()
        assert isinstance(get_adaptor("other-for-test", CompilationConfig(backend="eager")), Other)
    assert "other-for-test" not in adaptor_names()
    with pytest.raises(ConfigError, match="other-for-test"):
        get_adaptor("other-for-test", CompilationConfig(backend="eager"))
    assert resolve_platform("cpu") is None
    with register_platform("cpu", lambda: "fake"):
        assert resolve_platform("cpu") == "fake" and "cpu" in platform_names()
    assert resolve_platform("cpu") is None and "cpu" not in platform_names()


def test_scoped_tags_start_from_an_empty_registry_and_restore_the_outer_one():
    outer = unique_tag("ScopedTagModel")
    with scoped_tags():
        assert unique_tag("ScopedTagModel") == "ScopedTagModel"
        assert unique_tag("ScopedTagModel") == "ScopedTagModel_1"
    assert unique_tag("ScopedTagModel") == f"{outer}_1"


def test_runtime_modes_are_an_enum_that_still_compares_with_the_strings():
    assert RuntimeMode.FULL == "full" and RuntimeMode("sub_batch") is RuntimeMode.SUB_BATCH
    assert str(RuntimeMode.PIECEWISE) == "piecewise"
    assert ForwardContext(3, 4).runtime_mode is RuntimeMode.NONE


def test_the_forward_context_writers_nest_and_restore():
    assert forward_context() is None
    outer = ForwardContext(2, 4, RuntimeMode.PIECEWISE)
    token = enter_forward(outer)
    try:
        with set_forward_context(ForwardContext(1, 1)) as inner:
            assert forward_context() is inner
        assert forward_context() is outer
    finally:
        exit_forward(token)
    assert forward_context() is None


def test_cache_tool_errors_are_cache_errors(tmp_path):
    from piecewise.cache import tools
    from piecewise.cache.store import CacheIndexError

    assert issubclass(CacheIndexError, CacheError)
    with pytest.raises(CacheError, match="manifest|not a"):
        bogus = tmp_path / "a.tar.gz"
        import tarfile

        with tarfile.open(bogus, "w:gz") as tar:
            tar.add(__file__, arcname="x.txt")
        tools.import_archive(str(tmp_path / "root"), str(bogus))


def test_importing_something_that_is_not_an_archive_is_a_cache_error(tmp_path):
    from piecewise.cache import tools

    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"not a gzip file")
    with pytest.raises(CacheError, match="not an archive"):
        tools.import_archive(str(tmp_path / "root"), str(junk))
