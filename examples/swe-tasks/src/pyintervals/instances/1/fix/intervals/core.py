from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Interval:
    """The half-open interval [start, end): start is in it, end is not."""

    start: int
    end: int

    def __post_init__(self):
        if self.end < self.start:
            raise ValueError(f"interval end {self.end} is before its start {self.start}")

    def __len__(self):
        return self.end - self.start

    def contains(self, point):
        return self.start <= point < self.end

    def overlaps(self, other):
        return self.start < other.end and other.start < self.end


def merge(intervals):
    """Merges overlapping or touching intervals into a sorted list of disjoint ones.

    Touching intervals such as [1, 3) and [3, 5) cover [1, 5) without a gap,
    so they merge into one.
    """
    merged = []
    for interval in sorted(intervals):
        if merged and interval.start <= merged[-1].end:
            last = merged[-1]
            merged[-1] = Interval(last.start, max(last.end, interval.end))
        else:
            merged.append(interval)
    return merged


def total_length(intervals):
    """The number of integers covered by at least one interval."""
    return sum(len(interval) for interval in merge(intervals))
