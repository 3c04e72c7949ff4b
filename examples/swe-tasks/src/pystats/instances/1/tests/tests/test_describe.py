import unittest

from stats import StatisticsError, mean, median, mode


class TestMean(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([1, 2, 3, 4]), 2.5)

    def test_empty(self):
        with self.assertRaises(StatisticsError):
            mean([])


class TestMedian(unittest.TestCase):
    def test_odd_length(self):
        self.assertEqual(median([7, 1, 3]), 3)

    def test_single_value(self):
        self.assertEqual(median([42]), 42)

    def test_empty(self):
        with self.assertRaises(StatisticsError):
            median([])

    def test_even_length(self):
        self.assertEqual(median([4, 1, 3, 2]), 2.5)

    def test_two_values(self):
        self.assertEqual(median([10, 20]), 15)


class TestMode(unittest.TestCase):
    def test_most_common(self):
        self.assertEqual(mode([1, 2, 2, 3]), 2)

    def test_tie_prefers_first_seen(self):
        self.assertEqual(mode(["b", "a", "a", "b"]), "b")


if __name__ == "__main__":
    unittest.main()
