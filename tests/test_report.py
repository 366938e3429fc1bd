"""The run report: the results table with its notes, and the per-method accuracy panels."""

import json

from hetfl.report import accuracy_figure, results_table, write_plots


def result(acc: float, best: float, **extra) -> dict:
    return {"accuracy": acc, "best_accuracy": best, "seconds": 2.0, "server_seconds": 1.5, "bytes_up": 590234,
            "bytes_down": 1843, "per_class": [acc] * 10, **extra}


RESULTS = {
    "fedavg": result(50.3, 50.3, client_seconds=88.8),
    "ensemble": result(52.0, 52.0, client_seconds=88.8, cached_uploads=5),
    "feddf": result(52.3, 53.1, client_seconds=88.8, cached_uploads=5, params={"steps": 300, "eval_every": 50}),
    "dense": result(35.2, 41.8, client_seconds=88.8, cached_uploads=5,
                    params={"epochs": 8, "generator_steps": 8, "batch_size": 64}),
    "ours": result(46.4, 57.7, method="fedhydra", client_seconds=88.8, cached_uploads=5,
                   params={"epochs": 8, "generator_steps": 8, "batch_size": 64}),
    "central": result(98.9, 98.9, bytes_up=47_040_000, params={}),
}
CURVES = {"feddf": [(50, 40.0), (100, 45.0), (300, 52.3)],
          "dense": [(e, 20.0 + e) for e in range(1, 9)],
          "ours": [(1, 30.0), (2, 40.0), (2, 41.0), (8, 46.4)],  # a resumed epoch logged twice
          "central": [(5, 98.9)]}  # one evaluation: no panel


def test_results_table_has_the_columns_one_row_per_method_and_the_notes():
    lines = results_table(RESULTS).splitlines()
    assert lines[0].split() == ["method", "final", "acc", "%", "best", "acc", "%", "server", "s", "bytes", "up"]
    rows = lines[2:2 + len(RESULTS)]
    assert [row.split()[0] for row in rows] == list(RESULTS)
    assert len({len(x) for x in lines[:2 + len(RESULTS)]}) == 1  # one width
    assert rows[0].split()[1:4] == ["50.30", "50.30", "1.5"] and rows[-1].endswith("44.9 MB")
    budget, seconds = lines[2 + len(RESULTS):]
    # FedDF ran 300 of its 2,000 steps (15 %), the generator family 8 x 8 of 200 x 30 (1 %)
    assert budget.startswith("note: feddf (300 of 2,000 steps); dense, ours (8 of 200 epochs, "
                             "8 of 30 generator steps) ran a small part of their default budget")
    assert "accuracy.png" in budget and "docs/results/" in budget and "central" not in budget
    assert seconds == ("server s leaves out the clients' local training: 88.8 s (once, for the 5 methods "
                       "that share the uploads)")


def test_results_table_shows_the_validation_selected_accuracy_when_a_run_had_a_split():
    assert "val-sel." not in results_table(RESULTS)
    name = next(iter(RESULTS))
    with_val = {**RESULTS, name: {**RESULTS[name], "val_selected_accuracy": 42.25}}
    lines = results_table(with_val).splitlines()
    assert "val-sel. %" in lines[0] and "42.25" in next(x for x in lines if x.startswith(name))


def test_results_table_says_when_the_client_seconds_come_from_the_cache():
    cached = {name: {**r, "cached_uploads": 5} for name, r in RESULTS.items() if name != "central"}
    assert results_table(cached).splitlines()[-1].endswith("as measured when the cached uploads were trained")


def test_a_method_near_its_default_budget_gets_no_note():
    rows = {"feddf": result(60.0, 60.0, params={"steps": 1500}), "fedavg": result(50.0, 50.0, params={"rounds": 1})}
    assert len(results_table(rows).splitlines()) == 4  # header, rule, two rows


def test_accuracy_figure_has_one_panel_per_method_with_a_curve_each_in_its_own_unit():
    fig = accuracy_figure(CURVES, RESULTS)
    try:
        assert [ax.get_title().split(",")[0] for ax in fig.axes] == ["feddf", "dense", "ours"]
        assert [ax.get_xlabel() for ax in fig.axes] == ["distillation step (of 300)", "server epoch (of 8)",
                                                        "server epoch (of 8)"]
        assert [ax.get_xlim() for ax in fig.axes] == [(0.0, 300.0), (0.0, 8.0), (0.0, 8.0)]
        (line,) = fig.axes[2].get_lines()[:1]
        assert list(line.get_xdata()) == [1, 2, 8] and list(line.get_ydata()) == [30.0, 41.0, 46.4]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    assert accuracy_figure({"central": [(5, 98.9)]}, RESULTS) is None


def test_write_plots_is_deterministic(tmp_path):
    (tmp_path / "partition.json").write_text(json.dumps({"counts": [[5, 0, 1], [0, 7, 2]]}))
    rows = [{"method": name, "step": step, "accuracy": acc} for name, pts in CURVES.items() for step, acc in pts]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"config": {"name": "t"}, "results": RESULTS}
    written = write_plots(tmp_path, summary)
    assert [p.name for p in written] == ["partition.png", "accuracy.png", "results.png"]
    first = {p.name: p.read_bytes() for p in written}
    assert {p.name: p.read_bytes() for p in write_plots(tmp_path, summary)} == first
    assert all(b"Software" not in data for data in first.values())


def test_a_method_with_a_known_failure_at_chance_is_marked_and_explained():
    rows = {"fedavg": result(50.0, 50.0, method="fedavg", params={"rounds": 1}),
            "fedhydra": result(10.1, 10.3, method="fedhydra", params={"epochs": 200, "generator_steps": 30}),
            "fedhydra_dense_log1p": result(60.0, 61.0, method="fedhydra",
                                           params={"epochs": 200, "generator_steps": 30})}
    lines = results_table(rows).splitlines()
    assert lines[3].split()[:2] == ["fedhydra", "*"] and "*" not in lines[4]  # only the row at chance
    assert len({len(x) for x in lines[:5]}) == 1
    assert lines[-1].startswith("* fedhydra ended at 10.10 % (chance for 10 classes): FedHydra as its paper "
                                "writes it") and "docs/results/fedhydra.md" in lines[-1]
