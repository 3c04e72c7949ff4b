import pytest

from intervals import Interval, merge, total_length


def test_reversed_interval_is_rejected():
    with pytest.raises(ValueError):
        Interval(5, 1)


def test_contains_is_half_open():
    interval = Interval(1, 3)
    assert interval.contains(1)
    assert interval.contains(2)
    assert not interval.contains(3)


def test_merge_overlapping():
    assert merge([Interval(5, 8), Interval(1, 3), Interval(2, 6)]) == [Interval(1, 8)]


def test_merge_keeps_disjoint_apart():
    assert merge([Interval(6, 7), Interval(1, 2)]) == [Interval(1, 2), Interval(6, 7)]


def test_total_length_counts_overlap_once():
    assert total_length([Interval(0, 10), Interval(5, 15)]) == 15


def test_merge_touching():
    assert merge([Interval(3, 5), Interval(1, 3)]) == [Interval(1, 5)]


def test_merge_chain_of_touching():
    chain = [Interval(i, i + 1) for i in range(5)]
    assert merge(chain) == [Interval(0, 5)]
