"""jaxlm.planner.check_against_runs's statistics for speed measurements: the median's interval and the wall-time
shares."""

import pytest

from jaxlm.planner.check_against_runs import median_interval, wall_time_shares


def test_median_interval_is_the_order_statistics_interval():
  # n = 10: [x_(2), x_(9)] covers the median with 1 - 2 * 11 / 1024; n = 20: [x_(6), x_(15)], 1 - 2 * 21700 / 2^20.
  assert median_interval([5, 1, 9, 3, 7, 2, 10, 4, 8, 6]) == (2, 9, pytest.approx(1 - 22 / 1024))
  low, high, coverage = median_interval(range(1, 21))
  assert (low, high) == (6, 15) and coverage == pytest.approx(1 - 2 * 21700 / 2**20) and coverage >= 0.95
  # Too few values for 95%: the full range, and how sure it is.
  assert median_interval([1.02, 0.97, 1.10]) == (0.97, 1.10, 0.75)
  assert median_interval([0.9, 1.1]) == (0.9, 1.1, 0.5)
  assert median_interval([1.0]) == (1.0, 1.0, 0.0)
  with pytest.raises(ValueError, match="at least one value"):
    median_interval([])


def test_wall_time_shares_split_the_span_by_what_runs_at_once():
  # Thread 1: a matmul 0-50, a fusion 60-100. Thread 2: a reduce 40-70.
  intervals = [(0, 50, "matmul"), (60, 100, "elementwise"), (40, 70, "reduce")]
  assert wall_time_shares(intervals) == pytest.approx(
      {"library alone": 0.4, "library beside XLA ops": 0.1, "one XLA op": 0.4, "several XLA ops": 0.1})
  assert wall_time_shares([(0, 10, "custom-call"), (20, 30, "copy/transpose")]) == pytest.approx(
      {"library alone": 1 / 3, "nothing": 1 / 3, "one XLA op": 1 / 3})
  # One op ending as the next starts: no overlap counted; two library calls at once are still "library alone".
  assert wall_time_shares([(0, 10, "matmul"), (10, 20, "reduce")]) == pytest.approx(
      {"library alone": 0.5, "one XLA op": 0.5})
  assert wall_time_shares([(0, 10, "matmul"), (5, 10, "custom-call")]) == pytest.approx({"library alone": 1.0})
  assert wall_time_shares([]) == {}
