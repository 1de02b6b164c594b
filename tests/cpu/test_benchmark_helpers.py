"""The timing helpers behind benchmarks/ and `python -m cai_dlpack`: a group's rows are sampled in turns."""
import itertools
import time

from cai_dlpack._benchmark import measure_together, run_groups


def test_rows_are_sampled_in_turns_and_reversed_every_other_round():
    log = []
    calls = [lambda: log.append("a"), lambda: log.append("b"), lambda: log.append("c")]
    stats = measure_together(calls, repeat=4, target_seconds=1e-4)
    numbers = [s["calls"] for s in stats]
    sampled = log[len(log) - sum(numbers) * 4:]  # calibration first, then 4 rounds
    runs = [(name, len(list(group))) for name, group in itertools.groupby(sampled)]
    # Rounds abc, cba, abc, cba: a round's last row is the next round's first, so their samples adjoin.
    assert [name for name, _ in runs] == ["a", "b", "c", "b", "a", "b", "c", "b", "a"]
    a, b, c = numbers
    assert [count for _, count in runs] == [a, b, 2 * c, b, 2 * a, b, 2 * c, b, a]
    assert all(s["min"] <= s["median"] <= s["max"] for s in stats)


def test_a_slower_row_has_the_larger_ratio():
    def slow():
        time.sleep(0.0005)
    results = run_groups([("group", "fast", [("fast", lambda: None), ("slow", slow)])], repeat=3)
    (title, rows), = results
    ratios = {label: ratio for label, _, ratio in rows}
    assert title == "group" and ratios["fast"] == 1.0 and ratios["slow"] > 10
