"""Summary statistics for lists of numbers."""


def mean(values):
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)


def median(values):
    values.sort()
    return values[len(values) // 2]


def spread(values):
    if not values:
        raise ValueError("spread of an empty list")
    return max(values) - min(values)
