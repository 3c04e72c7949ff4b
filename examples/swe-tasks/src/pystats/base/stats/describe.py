from collections import Counter


class StatisticsError(ValueError):
    """Raised for input a statistic is not defined on (empty data)."""


def mean(data):
    data = list(data)
    if not data:
        raise StatisticsError("mean of empty data")
    return sum(data) / len(data)


def median(data):
    """The middle value; for an even number of values, the mean of the two middle ones."""
    data = sorted(data)
    n = len(data)
    if n == 0:
        raise StatisticsError("median of empty data")
    middle = n // 2
    if n % 2 == 1:
        return data[middle]
    return (data[middle] + data[middle + 1]) / 2


def mode(data):
    """The most common value; on a tie, the one seen first."""
    counts = Counter(data)
    if not counts:
        raise StatisticsError("mode of empty data")
    return counts.most_common(1)[0][0]
