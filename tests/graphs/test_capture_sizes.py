"""Capture-size schedules, padding, and the padding-minimising planner (docs/design.md §6.4, §6.5). CPU only."""

import contextlib
import itertools
import logging
import random

import pytest

from piecewise.errors import ConfigError, InputError
from piecewise.graphs.planner import plan_capture_sizes
from piecewise.graphs.capture_sizes import (
    PaddingTable,
    default_capture_sizes,
    pad_to_capture_size,
    padding_fraction,
    padding_stats,
    padding_waste,
    validate_capture_sizes,
    windowed_capture_sizes,
)


@contextlib.contextmanager
def captured_logs():
    """Records of the ``piecewise`` logger, DEBUG and up, without relying on pytest's logging
    plugin (the suite may run with ``-p no:logging``)."""
    logger = logging.getLogger("piecewise")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def brute_force_waste(histogram, *, max_graphs=None, max_bytes=None, cost=None, must_include=()):
    """Least padding over every schedule drawn from the observed sizes and `must_include` that
    holds the forced sizes and fits the budgets; None when none fits."""
    forced = set(must_include) | {max(histogram)}
    free = sorted(set(histogram) - forced)
    best = None
    for r in range(len(free) + 1):
        for extra in itertools.combinations(free, r):
            schedule = sorted(forced | set(extra))
            if max_graphs is not None and len(schedule) > max_graphs:
                continue
            if max_bytes is not None and sum(cost(s) for s in schedule) > max_bytes:
                continue
            w = padding_waste(schedule, histogram)
            best = w if best is None else min(best, w)
    return best


def random_histogram(rng, n_sizes, top):
    return {rng.randint(1, top): rng.choice([rng.randint(1, 50), rng.random()]) for _ in range(n_sizes)}


# -- default schedule ----------------------------------------------------------------------------
def test_default_schedule_is_1_2_4_then_every_8_to_256_then_every_16():
    sizes = default_capture_sizes(512)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24]
    upto_256 = [s for s in sizes if s <= 256]
    assert upto_256 == [1, 2, 4, *range(8, 257, 8)]
    assert [s for s in sizes if s >= 256] == list(range(256, 513, 16))
    assert sizes == sorted(set(sizes))


def test_default_schedule_keeps_an_off_grid_maximum():
    assert default_capture_sizes(300)[-4:] == [256, 272, 288, 300]
    assert default_capture_sizes(100)[-3:] == [88, 96, 100]
    assert default_capture_sizes(3) == [1, 2, 3]
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(256)[-1] == 256 and default_capture_sizes(256).count(256) == 1


@pytest.mark.parametrize("bad", [0, -8, 2.5, True, "256"])
def test_default_schedule_rejects_a_bad_maximum(bad):
    with pytest.raises(ConfigError, match="max_capture_size"):
        default_capture_sizes(bad)


# -- windowed schedule ---------------------------------------------------------------------------
def literal_windowed(w, bound):
    """docs/design.md §6.5 spelled out: start at w, step by max(w, 2**max(s.bit_length() - 4, 0))."""
    out, s = [], w
    while s < bound:
        out.append(s)
        s += max(w, 2 ** max(s.bit_length() - 4, 0))
    return sorted(set(out + [bound]))


def test_windowed_w4_steps_by_256_inside_2048_to_4096():
    sizes = windowed_capture_sizes(4, 8192, 2048, 8192)
    inside = [s for s in sizes if 2048 <= s <= 4096]
    assert inside == list(range(2048, 4097, 256))
    assert sizes[:4] == [4, 8, 12, 16]  # by w while w is the wider step
    assert all(b - a == 512 for a, b in zip(sizes, sizes[1:]) if 4096 <= a < 8192)
    assert sizes[-1] == 8192


@pytest.mark.parametrize("w, max_capture_size, max_num_seqs", [(1, 512, 256), (2, 1000, 400), (3, 4096, 1024),
                                                               (4, 8192, 2048), (5, 777, 100), (7, 4000, 600)])
def test_windowed_schedule_follows_the_spec_rule(w, max_capture_size, max_num_seqs):
    sizes = windowed_capture_sizes(w, max_capture_size, max_num_seqs, 100_000)
    bound = min(max_capture_size, max_num_seqs * w)
    assert sizes == literal_windowed(w, bound)
    assert sizes == sorted(set(sizes))
    assert sizes[0] == w and sizes[-1] == bound
    assert all(w <= s <= bound for s in sizes)


def test_windowed_bound_is_the_request_limit_when_smaller():
    sizes = windowed_capture_sizes(4, 8192, 100, 8192)
    assert sizes[-1] == 400 and 400 in sizes and max(sizes) == 400


def test_windowed_power_of_two_w_gives_whole_requests_on_its_own():
    for w in (1, 2, 4, 8):
        sizes = windowed_capture_sizes(w, 8192, 4096, 8192)
        assert all(s % w == 0 for s in sizes)
        assert sizes == windowed_capture_sizes(w, 8192, 4096, 8192, whole_requests=True)


def test_windowed_whole_requests_rounds_the_step_up_to_a_multiple_of_w():
    w = 3
    literal = windowed_capture_sizes(w, 6144, 2048, 8192)
    assert any(s % w for s in literal[:-1])  # the spec rule alone leaves partial requests
    sizes = windowed_capture_sizes(w, 6144, 2048, 8192, whole_requests=True)
    assert all(s % w == 0 for s in sizes) and sizes[-1] == 6144
    for a, b in zip(sizes, sizes[1:-1]):
        spec_step = max(w, 2 ** max(a.bit_length() - 4, 0))
        assert b - a == -(-spec_step // w) * w  # smallest multiple of w >= the spec step


def test_windowed_schedule_above_the_token_budget_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        windowed_capture_sizes(4, 8192, 2048, 4096)
    msg = str(e.value)
    assert "8192" in msg and "max_num_batched_tokens=4096" in msg and "raise" in msg
    assert windowed_capture_sizes(4, 8192, 1024, 4096)[-1] == 4096  # bound lowered by max_num_seqs: fits


@pytest.mark.parametrize("args, name", [((0, 512, 256, 8192), "w"), ((4, 0, 256, 8192), "max_capture_size"),
                                        ((4, 512, -1, 8192), "max_num_seqs"), ((4, 512, 256, 0), "max_num_batched_tokens"),
                                        ((2.0, 512, 256, 8192), "w"), ((8, 4, 256, 8192), "max_capture_size=4")])
def test_windowed_schedule_validates_inputs(args, name):
    with pytest.raises(ConfigError, match=name):
        windowed_capture_sizes(*args)


# -- validation ----------------------------------------------------------------------------------
def test_validate_drops_sizes_above_max_num_tokens_and_logs_both_lists():
    with captured_logs() as records:
        kept, dropped = validate_capture_sizes([512, 8, 1, 1024, 8, 640, 256], 512)
    assert kept == [1, 8, 256, 512]
    assert dropped == [640, 1024]
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    infos = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert len(warnings) == 1 and "[640, 1024]" in warnings[0] and "max_num_tokens=512" in warnings[0]
    assert len(infos) == 1 and "[1, 8, 256, 512]" in infos[0]


def test_validate_without_drops_logs_no_warning():
    with captured_logs() as records:
        kept, dropped = validate_capture_sizes(default_capture_sizes(300), 300)
    assert kept == default_capture_sizes(300) and dropped == []
    assert [r.levelno for r in records] == [logging.INFO]


@pytest.mark.parametrize("bad", [[1, 0], [4, -8], [2.0], [True], ["8"], 8, "1,2"])
def test_validate_rejects_non_positive_or_non_integer_sizes(bad):
    with pytest.raises(ConfigError):
        validate_capture_sizes(bad, 512)


# -- padding -------------------------------------------------------------------------------------
def test_pad_to_capture_size_picks_the_smallest_size_at_or_above():
    sizes = [1, 2, 4, 8, 16]
    assert [pad_to_capture_size(n, sizes) for n in range(0, 18)] == [1, 1, 2, 4, 4, *[8] * 4, *[16] * 8, None]
    assert pad_to_capture_size(5, [16, 8, 4]) == 8  # any order
    assert pad_to_capture_size(3, []) is None
    with pytest.raises(InputError):
        pad_to_capture_size(-1, sizes)


def test_padding_table_agrees_with_the_rule_everywhere():
    rng = random.Random(3)
    sizes = sorted(rng.sample(range(1, 300), 20))
    table = PaddingTable(sizes, 256)
    for n in range(0, 400):
        assert table.padded(n) == pad_to_capture_size(n, sizes), n
    assert table.sizes == tuple(sizes) and table.max_n == 256
    empty = PaddingTable([], 64)
    assert empty.padded(0) is None and empty.padded(64) is None and empty.padded(65) is None
    with pytest.raises(InputError):
        table.padded(-1)
    with pytest.raises(ConfigError):
        PaddingTable([0, 8], 64)
    with pytest.raises(ConfigError):
        PaddingTable([8], -1)


# -- padding accounting --------------------------------------------------------------------------
def test_padding_waste_and_fraction_on_a_hand_computed_example():
    histogram = {1: 2, 3: 1, 5: 4, 8: 1, 9: 3}
    # 1 -> 4: 2 * 3; 3 -> 4: 1 * 1; 5 -> 8: 4 * 3; 8 -> 8: 0; 9: above 8, runs without graphs.
    stats = padding_stats([4, 8], histogram)
    assert stats.pad_rows == 19
    assert stats.real_rows == 2 * 1 + 3 + 4 * 5 + 8 + 3 * 9 == 60
    assert stats.computed_rows == 79
    assert stats.uncovered == (9,) and stats.uncovered_count == 3
    assert padding_waste([8, 4], histogram) == 19
    assert padding_fraction([4, 8], histogram) == pytest.approx(19 / 79)


def test_padding_waste_with_frequencies_is_expected_pad_rows_per_batch():
    assert padding_waste([4], {1: 0.5, 3: 0.5}) == pytest.approx(0.5 * 3 + 0.5 * 1)
    assert padding_waste([1, 3], {1: 0.5, 3: 0.5}) == 0
    assert padding_fraction([], {1: 1.0}) == 0.0  # nothing captured: nothing padded
    assert padding_stats([], {1: 1.0}).uncovered == (1,)


@pytest.mark.parametrize("histogram", [{0: 1}, {-2: 1}, {1.5: 1}, {4: -1}, {4: float("nan")}, {4: float("inf")}, [1, 2]])
def test_padding_accounting_rejects_a_bad_histogram(histogram):
    with pytest.raises(ConfigError):
        padding_waste([8], histogram)


# -- planner -------------------------------------------------------------------------------------
def test_planner_on_a_hand_worked_example():
    histogram = {1: 10, 2: 1, 8: 1}
    # [8]: 10 * 7 + 6 = 76; [2, 8]: 10 * 1 = 10; [1, 8]: 6.
    assert plan_capture_sizes(histogram, max_graphs=1) == [8]
    assert plan_capture_sizes(histogram, max_graphs=2) == [1, 8]
    assert plan_capture_sizes(histogram, max_graphs=3) == [1, 2, 8]
    assert plan_capture_sizes(histogram, max_graphs=30) == [1, 2, 8]


@pytest.mark.parametrize("seed", range(6))
def test_planner_matches_brute_force_under_a_graph_budget(seed):
    rng = random.Random(seed)
    for _ in range(25):
        histogram = random_histogram(rng, rng.randint(1, 9), 64)
        must = rng.sample(range(1, 80), rng.randint(0, 1))
        for max_graphs in range(1, 5):
            expected = brute_force_waste(histogram, max_graphs=max_graphs, must_include=must)
            if len(set(must) | {max(histogram)}) > max_graphs:
                with pytest.raises(ConfigError, match="max_graphs"):
                    plan_capture_sizes(histogram, max_graphs=max_graphs, must_include=must)
                continue
            plan = plan_capture_sizes(histogram, max_graphs=max_graphs, must_include=must)
            assert padding_waste(plan, histogram) == pytest.approx(expected, rel=1e-9, abs=1e-9)
            assert len(plan) <= max_graphs and plan == sorted(set(plan))
            assert max(histogram) in plan and set(must) <= set(plan)
            assert set(plan) <= set(histogram) | set(must)


@pytest.mark.parametrize("seed", range(4))
def test_planner_matches_brute_force_under_a_byte_budget(seed):
    rng = random.Random(100 + seed)
    costs = [lambda s: 2 * s, lambda s: 100 + 3 * s]
    for _ in range(20):
        histogram = random_histogram(rng, rng.randint(1, 9), 64)
        must = rng.sample(range(1, 80), rng.randint(0, 1))
        cost = rng.choice(costs)
        max_bytes = rng.randint(100, 1200)
        for max_graphs in (None, rng.randint(2, 4)):
            expected = brute_force_waste(histogram, max_graphs=max_graphs, max_bytes=max_bytes, cost=cost,
                                         must_include=must)
            kwargs = dict(max_graphs=max_graphs, max_bytes=max_bytes, must_include=must)
            if expected is None:
                with pytest.raises(ConfigError):
                    plan_capture_sizes(histogram, bytes_per_token=cost, **kwargs)
                continue
            plan = plan_capture_sizes(histogram, bytes_per_token=cost, **kwargs)
            assert padding_waste(plan, histogram) == pytest.approx(expected, rel=1e-9, abs=1e-9)
            assert sum(cost(s) for s in plan) <= max_bytes
            assert max_graphs is None or len(plan) <= max_graphs
            assert max(histogram) in plan and set(must) <= set(plan)


def test_planner_linear_bytes_per_token_respects_the_budget():
    rng = random.Random(7)
    histogram = {n: rng.random() * 100 for n in range(1, 257)}
    for max_bytes in (256 * 4, 3000 * 4, 10_000 * 4):
        plan = plan_capture_sizes(histogram, max_bytes=max_bytes, bytes_per_token=4)
        assert 4 * sum(plan) <= max_bytes and plan[-1] == 256
    everything = plan_capture_sizes(histogram, max_bytes=10**9, bytes_per_token=4)
    assert everything == list(range(1, 257)) and padding_waste(everything, histogram) == 0


@pytest.mark.parametrize("seed", range(3))
def test_planner_never_pads_more_than_the_default_schedule_with_as_many_graphs(seed):
    rng = random.Random(200 + seed)
    top = rng.choice([100, 300, 512])
    histogram = {n: rng.random() for n in rng.sample(range(1, top + 1), top // 2)}
    histogram[top] = 1.0
    default = default_capture_sizes(top)
    for k in (1, 2, 5, 10, len(default)):
        truncated = default[-k:]  # k graphs of the default schedule, covering the same maximum
        plan = plan_capture_sizes(histogram, max_graphs=k)
        assert len(plan) <= k and plan[-1] == top
        assert padding_waste(plan, histogram) <= padding_waste(truncated, histogram) + 1e-9


def test_planner_scales_to_thousands_of_sizes_and_hundreds_of_graphs():
    rng = random.Random(11)
    histogram = {n: rng.random() * 100 for n in rng.sample(range(1, 8193), 3000)}
    plan = plan_capture_sizes(histogram, max_graphs=150)
    assert len(plan) == 150 and plan[-1] == max(histogram)
    default = default_capture_sizes(max(histogram))
    assert padding_waste(plan, histogram) <= padding_waste(default[-150:], histogram)


def test_planner_search_limit_returns_a_feasible_schedule_and_warns():
    histogram = {n: 1000 / n for n in range(1, 65)}
    exact = plan_capture_sizes(histogram, max_bytes=200, bytes_per_token=1)
    with captured_logs() as records:
        capped = plan_capture_sizes(histogram, max_bytes=200, bytes_per_token=1, search_limit=1)
    assert sum(capped) <= 200 and capped[-1] == 64
    assert padding_waste(capped, histogram) >= padding_waste(exact, histogram)
    assert any("search_limit=1" in r.getMessage() for r in records if r.levelno == logging.WARNING)


def test_planner_counts_must_include_against_the_budget():
    histogram = {1: 100, 2: 100, 3: 100, 64: 1}
    # One free graph: 3 pads 1 and 2 up to 3 (300 rows); 2 or 1 leaves 3 padding to 64.
    assert plan_capture_sizes(histogram, max_graphs=3, must_include=[128]) == [3, 64, 128]
    assert plan_capture_sizes(histogram, max_graphs=2, must_include=[128]) == [64, 128]


@pytest.mark.parametrize("kwargs, fragment", [
    ({}, "budget"),
    ({"max_graphs": 0}, "max_graphs"),
    ({"max_graphs": 1, "must_include": [4]}, "max_graphs=1"),
    ({"max_bytes": 1000}, "bytes_per_token"),
    ({"max_graphs": 2, "bytes_per_token": 2}, "max_bytes"),
    ({"max_bytes": 10, "bytes_per_token": 1}, "max_bytes=10"),
    ({"max_bytes": -1, "bytes_per_token": 1}, "max_bytes"),
    ({"max_bytes": 100, "bytes_per_token": lambda s: 100 - s}, "must not decrease"),
    ({"max_graphs": 2, "must_include": [0]}, "must_include"),
])
def test_planner_config_errors_name_the_value(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        plan_capture_sizes({1: 5, 16: 1}, **kwargs)


def test_planner_rejects_an_empty_histogram():
    with pytest.raises(ConfigError, match="histogram"):
        plan_capture_sizes({4: 0}, max_graphs=2)
