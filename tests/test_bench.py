import json

from course_lib.tools import bench, cli


def test_goal_check():
    assert bench.meets(1.1, "<= 1.2") is True
    assert bench.meets(1.3, "<= 1.2") is False
    assert bench.meets(0.7, ">= 0.5") is True
    assert bench.meets(3.0, None) is None


def test_table_marks_missed_goals():
    text = bench.format_table({"a": {"value": 1.5, "goal": "<= 1.2"}, "b": {"value": 0.1, "goal": "<= 0.5"}})
    lines = text.splitlines()
    assert lines[0].split() == ["benchmark", "value", "goal", "met"]
    assert lines[1].split()[-1] == "NO" and lines[2].split()[-1] == "yes"


def test_bench_json_runs_a_benchmark(capsys):
    assert cli.main(["bench", "--json", "--only", "memory"]) == 0
    out = capsys.readouterr().out
    table = json.loads(out)  # progress goes to stderr: stdout is pure JSON
    assert table["estimator_error"]["goal"] == "<= 0.05"
    assert 0 <= table["estimator_error"]["value"] < 0.05
