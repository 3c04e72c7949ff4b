import sys
import unittest

sys.path.insert(0, "/app")
import stats  # noqa: E402


class MedianTest(unittest.TestCase):
    def test_odd(self):
        self.assertEqual(stats.median([3, 1, 2]), 2)

    def test_even(self):
        self.assertEqual(stats.median([4, 1, 3, 2]), 2.5)

    def test_argument_unchanged(self):
        values = [3, 1, 2, 0]
        stats.median(values)
        self.assertEqual(values, [3, 1, 2, 0])

    def test_empty(self):
        with self.assertRaises(ValueError):
            stats.median([])

    def test_others_unchanged(self):
        self.assertEqual(stats.mean([1, 2, 3, 6]), 3)
        self.assertEqual(stats.spread([5, -1, 2]), 6)


if __name__ == "__main__":
    unittest.main()
