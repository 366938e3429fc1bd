"""hetfl frontier: one-shot points and multi-round curves on one axis of bytes, the Pareto front, the tables."""

from __future__ import annotations

import copy
import csv
import json
import random
from pathlib import Path

from hetfl.cli import main
from hetfl.engine.simulator import Simulator, prepare
from hetfl.frontier import (
    Curve,
    Panel,
    Point,
    budgets_table,
    one_shot_overtaken,
    overtaken_line,
    panel_front,
    pareto,
    targets_table,
)
from hetfl.methods.checks import validate
from tests.test_training import slow_sample_passes


def slow_front(points: list[tuple[float, float]]) -> set[int]:
    """The definition: no other point has fewer-or-equal bytes and higher-or-equal accuracy, one strictly;
    of exact duplicates, the first."""
    front = set()
    for i, (b, a) in enumerate(points):
        dominated = any((b2 <= b and a2 >= a and (b2 < b or a2 > a)) or ((b2, a2) == (b, a) and j < i)
                        for j, (b2, a2) in enumerate(points) if j != i)
        if not dominated:
            front.add(i)
    return front


def test_pareto_front_equals_the_definition_on_random_points_with_ties() -> None:
    rng = random.Random(0)
    for _ in range(200):
        points = [(rng.choice([1.0, 2.0, 3.0, 5.0, 8.0]), rng.choice([10.0, 20.0, 30.0, 40.0]))
                  for _ in range(rng.randint(1, 12))]
        got = pareto(points)
        assert {points[i] for i in got} == {points[i] for i in slow_front(points)}
        assert len(got) == len(set(points[i] for i in got))  # one point per front position


def test_tables_pick_the_cheapest_method_per_target_and_the_best_per_budget() -> None:
    mib = 1 << 20
    panel = Panel(("k",), "t", "final", curves=[
        Curve("r", "oneshot", "one-shot", [Point(5 * mib, 62.0, 0, 10.0)]),
        Curve("r", "rounds", "rounds", [Point(2 * mib, 40.0, 1, 1.0), Point(4 * mib, 55.0, 2, 2.0),
                                        Point(50 * mib, 91.0, 3, 3.0)])])
    targets = {row["target"]: (row["method"], row["round"]) for row in targets_table(panel)}
    assert targets == {50.0: ("rounds", 2), 60.0: ("oneshot", 0), 70.0: ("rounds", 3), 80.0: ("rounds", 3),
                       90.0: ("rounds", 3)}
    budgets = {row["budget_mib"]: (row["method"], row["accuracy"]) for row in budgets_table(panel)}
    assert budgets == {1.0: (None, None), 10.0: ("oneshot", 62.0), 100.0: ("rounds", 91.0),
                       1000.0: ("rounds", 91.0)}
    assert [(c.method, p.round) for c, p in panel_front(panel)] == [("rounds", 1), ("rounds", 2), ("oneshot", 0),
                                                                    ("rounds", 3)]



def test_round_methods_meet_the_best_one_shot_point_within_its_bytes_and_above_it() -> None:
    mib = 1 << 20
    shots = [Curve("r", "weak", "one-shot", [Point(1 * mib, 50.0, 0, 1.0)]),
             Curve("r", "oneshot", "one-shot", [Point(5 * mib, 62.0, 0, 10.0)]),
             Curve("r", "costly", "one-shot", [Point(9 * mib, 62.0, 0, 10.0)])]  # as good, more MiB
    rounds = Curve("r", "rounds", "rounds", [Point(2 * mib, 40.0, 1, 1.0), Point(4 * mib, 55.0, 2, 2.0),
                                             Point(5 * mib, 62.0, 3, 3.0), Point(50 * mib, 91.0, 4, 4.0)])
    meet = one_shot_overtaken(Panel(("k",), "t", "final", curves=[*shots, rounds]))
    assert meet["one_shot"][0].method == "oneshot"
    assert meet["within"][1].round == 3 and meet["above"][1].round == 4  # equal accuracy does not pass it
    assert overtaken_line(Panel(("k",), "t", "final", curves=[*shots, rounds])) == (
        "Best one-shot model: oneshot, 62.00 % at 5.0 MiB. Within those MiB the best round method reaches "
        "62.00 % (rounds, round 3); the first to pass it is rounds at round 4 (50.0 MiB, 91.00 %).")
    late = Curve("r", "late", "rounds", [Point(6 * mib, 30.0, 1, 1.0)])
    assert overtaken_line(Panel(("k",), "t", "final", curves=[*shots, late])) == (
        "Best one-shot model: oneshot, 62.00 % at 5.0 MiB. No round method fits in those MiB; none passes it.")
    early = Curve("r", "early", "rounds", [Point(2 * mib, 70.0, 2, 1.0)])
    assert overtaken_line(Panel(("k",), "t", "final", curves=[*shots, early])) == (
        "Best one-shot model: oneshot, 62.00 % at 5.0 MiB. A round method passes it within those MiB: early at "
        "round 2 (2.0 MiB, 70.00 %).")
    assert one_shot_overtaken(Panel(("k",), "t", "final", curves=[late])) is None
    assert overtaken_line(Panel(("k",), "t", "final", curves=shots)) == ""

FED = {
    "seed": 0, "dataset": "synthetic", "validation": 0.2,
    "data": {"train_per_class": 40, "test_per_class": 20, "size": 16, "classes": 4, "noise": 0.2},
    "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5}, "clients": 3,
    "client": {"model": "cnn2", "epochs": 2, "batch_size": 32, "lr": 0.1}, "server": {"model": "cnn2"},
}


def simulate(tmp_path: Path, name: str, methods: dict, **changes) -> Path:
    cfg = validate({**copy.deepcopy(FED), "name": name, "methods": methods, **changes})
    Simulator(prepare(cfg), tmp_path / name, cache_dir=None, quiet=True, resume=False).run()
    return tmp_path / name


def test_frontier_of_a_one_shot_and_a_multi_round_run(tmp_path: Path, capsys) -> None:
    one = simulate(tmp_path, "one", {"ensemble": {}})
    rounds = simulate(tmp_path, "rounds", {"fedavg": {"rounds": 3}})
    other = simulate(tmp_path, "other", {"fedavg": {"rounds": 2}}, clients=2)  # another federation
    again = simulate(tmp_path, "again", {"ensemble": {}})  # the same method, the same federation
    out = tmp_path / "front"
    assert main(["frontier", str(one), str(rounds), str(other), str(again), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| target accuracy (validation-picked) | cheapest method |" in text
    assert "| 1,000 MiB |" in text and "2 panels" in text
    assert f"left out: {again}: ensemble already comes from another run of the same federation" in text
    assert (out / "frontier.png").stat().st_size > 10_000
    rows = list(csv.DictReader((out / "frontier.csv").open()))
    first = [r for r in rows if r["panel"] == "1"]
    assert [(r["method"], r["family"], r["round"]) for r in first] == [("ensemble", "one-shot", "0"),
                                                                      ("fedavg", "rounds", "1"),
                                                                      ("fedavg", "rounds", "2"),
                                                                      ("fedavg", "rounds", "3")]
    summary = json.loads((rounds / "summary.json").read_text())["results"]["fedavg"]
    last = first[-1]
    assert int(last["bytes"]) == summary["bytes_up"] + summary["bytes_down"] + summary["bytes_peer"]
    assert float(last["accuracy"]) == round(summary["val_selected_accuracy"], 4)  # the pick, not the last model
    points = [(float(r["bytes"]), float(r["accuracy"])) for r in first]
    assert {i for i, r in enumerate(first) if r["on_front"] == "1"} == slow_front(points)
    # the clients' seconds: cumulative per round, the summary's at the end; the server's are the rest
    client = [float(r["client_seconds"]) for r in first[1:]]
    assert 0 < client[0] <= client[1] <= client[2] and abs(client[-1] - summary["client_seconds"]) < 0.01
    assert abs(summary["server_seconds"] - (summary["seconds"] - summary["exchange_seconds"])) < 1e-9
    assert summary["exchange_seconds"] >= summary["client_seconds"]  # the exchanges' wall time holds the clients'
    assert all(abs(float(r["client_seconds"]) + float(r["server_seconds"]) - float(r["seconds"])) < 0.5
               for r in first)  # apart from the exchanges' own bookkeeping
    shot = json.loads((one / "summary.json").read_text())["results"]["ensemble"]
    assert abs(float(first[0]["client_seconds"]) - shot["client_seconds"]) < 0.01
    assert "| ensemble | one-shot | one shot |" in text and "| fedavg | rounds | 3 |" in text  # the cost table
    assert main(["frontier", str(one), str(rounds), "--out", str(tmp_path / "c"), "--x", "client_seconds"]) == 0
    assert (tmp_path / "c" / "frontier.png").stat().st_size > 10_000
    # the clients' sample-passes: every sample of every step (2 epochs at batch 32) of the clients that trained
    sizes = [sum(row) for row in json.loads((rounds / "partition.json").read_text())["counts"]]
    per_client = [slow_sample_passes(n, 32, 2) for n in sizes]
    assert int(first[0]["client_sample_passes"]) == shot["client_sample_passes"] == sum(per_client)
    metrics = [json.loads(line) for line in (rounds / "metrics.jsonl").read_text().splitlines()]
    trained = [sum(per_client[c] for c in r["clients"]) for r in metrics if r.get("step", 0) >= 1]
    assert [int(r["client_sample_passes"]) for r in first[1:]] == [sum(trained[:i + 1]) for i in range(3)]
    assert summary["client_sample_passes"] == sum(trained)
    assert main(["frontier", str(one), str(rounds), "--out", str(tmp_path / "p"), "--x", "client_passes"]) == 0
    assert (tmp_path / "p" / "frontier.png").stat().st_size > 10_000
    assert f" | {sum(per_client):,} |" in capsys.readouterr().out  # the cost table's last column
