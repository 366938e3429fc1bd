"""`hetfl reproduce`: paper grids as data, the generic grid runner and the results page."""

import argparse
import json
from pathlib import Path

import pytest

from hetfl.cli import main
from hetfl.config import ConfigError
from hetfl.methods.checks import validate
from hetfl.reproduce.paper import Paper, cell_config, grid, load_paper, paper_names
from hetfl.reproduce.report import condense, write_results
from hetfl.reproduce.runner import finished, run_cell, run_grid

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


@pytest.mark.parametrize("name", ["fedhydra", "fedmho", "kdia", "hfldd", "frontier"])
def test_every_cell_of_every_budget_is_a_valid_config(name):
    paper = load_paper(name)
    for budget in paper.budgets:
        cells = grid(paper, budget, list(paper.datasets), list(paper.settings), paper.seeds)
        assert len({c["name"] for c in cells}) == len(paper.datasets) * len(paper.settings) * len(paper.seeds)
        for cfg in cells[:: len(paper.seeds)]:
            validate(cfg)


def test_budget_values_and_overrides_fill_the_template():
    hydra = load_paper("fedhydra")
    cfg = cell_config(hydra, "mnist", "2c/c", 1, "paper")
    assert cfg["name"] == "fedhydra-mnist-2cc-s1-paper" and cfg["partition"] == {"kind": "2c/c"}
    assert cfg["client"]["epochs"] == 200 and cfg["methods"]["dense"]["epochs"] == 200
    assert cfg["methods"]["fedhydra_dense_log1p"]["temperature"] == 20.0  # the budget's override of ours
    assert "temperature" not in cfg["methods"]["fedhydra"]
    mho = load_paper("fedmho")
    cfg = cell_config(mho, "fmnist", "0.1", 0, "vgg9-e10-feddf-partition")
    assert cfg["partition"] == {"kind": "feddf_dirichlet", "alpha": 0.1}  # null removes min_size
    assert cfg["client"]["precision"] == "bf16" and cfg["client"]["model"][:1] == ["vgg9"]
    assert cfg["methods"]["fedmho_sd"] == {"cvae_epochs": 10}


def test_unknown_paper_budget_or_setting_fail_with_the_choices(tmp_path, capsys):
    assert main(["reproduce", "fedhydra", "--budget", "huge", "--out", str(tmp_path)]) == 2
    assert "--budget: unknown 'huge'; choose from: reduced-t60-g30, reduced, paper" in capsys.readouterr().err
    assert main(["reproduce", "fedmho", "--settings", "0.7", "--out", str(tmp_path)]) == 2
    assert "--settings: unknown ['0.7']; choose from: 0.5, 0.3, 0.1" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="unknown paper 'nope'; choose one of: fedhydra, fedmho, frontier, hfldd, "
                                          "kdia"):
        load_paper("nope")
    assert {"fedhydra", "fedmho", "kdia"} <= set(paper_names())


@pytest.mark.parametrize("name", ["fedhydra", "fedmho", "kdia", "hfldd", "frontier"])
def test_report_only_regenerates_the_committed_page_byte_for_byte(tmp_path, name):
    paper = load_paper(name)
    out = tmp_path / f"{name}.md"
    write_results(paper, tmp_path / "no-runs", out, RESULTS / f"{name}-runs.json")
    assert out.read_text() == (RESULTS / f"{name}.md").read_text()
    for png in tmp_path.glob("*.png"):
        assert png.read_bytes() == (RESULTS / png.name).read_bytes()
    assert len(out.read_text().splitlines()) <= 300


def test_kdia_smoke_budget_runs_every_method_and_writes_the_page(tmp_path, capsys):
    page = tmp_path / "page" / "kdia.md"
    assert main(["reproduce", "kdia", "--budget", "smoke", "--out", str(tmp_path / "runs"), "--results", str(page),
                 "--no-cache", "--quiet"]) == 0
    summary = json.loads((tmp_path / "runs" / "kdia-synthetic-b0.5-s0-smoke" / "summary.json").read_text())
    assert set(summary["results"]) == {"fedavg", "fedavgm", "fedprox", "moon", "fedgkd", "feddisco", "fedcog", "kdia"}
    assert summary["config"]["methods"]["fedcog"]["kd_weight"] == 0.01
    text = page.read_text()
    assert "## Budget `smoke`" in text and "rounds to FedAvg's best" in text and "teacher >= student" in text
    cell = cell_config(load_paper("kdia"), "mnist", "0.1", 0, "reduced")  # KDIA's lambda_gen per beta
    assert cell["methods"]["kdia"]["lambda_gen"] == 0.01 and "lambda_gen" not in cell["methods"]["fedavg"]
    assert "lambda_gen" not in cell_config(load_paper("kdia"), "mnist", "0.5", 0, "reduced")["methods"]["kdia"]


@pytest.mark.parametrize("setting", ["0.1", "0.5"])
def test_kdia_ablation_variants_differ_from_kdia_in_their_own_keys_only(setting):
    cell = cell_config(load_paper("kdia"), "fmnist", setting, 0, "ablation")
    methods = cell["methods"]
    assert set(methods) == {"fedavg", "kdia", "kdia_am", "kdia_intv", "kdia_part", "kdia_num", "kdia_no_kd",
                            "kdia_no_gen"}
    reduced = cell_config(load_paper("kdia"), "fmnist", setting, 0, "reduced")  # Table 7's base: the same FedAvg
    assert methods["fedavg"] == reduced["methods"]["fedavg"] and methods["kdia"] == reduced["methods"]["kdia"]
    assert {k: v for k, v in cell.items() if k not in ("name", "methods")} == \
        {k: v for k, v in reduced.items() if k not in ("name", "methods")}
    base = methods["kdia"]
    own = {"kdia_am": {"teacher_weights": "am", "select": "teacher"},
           "kdia_intv": {"teacher_weights": "intv", "select": "teacher"},
           "kdia_part": {"teacher_weights": "part", "select": "teacher"},
           "kdia_num": {"teacher_weights": "num", "select": "teacher"},
           "kdia_no_kd": {"lambda_kd": 0.0}}
    for name, keys in own.items():
        assert methods[name] == {**base, "method": "kdia", **keys}, name
    no_gen = methods["kdia_no_gen"]  # no generator is trained, so its budget keys do not matter
    assert no_gen["lambda_gen"] == 0.0 and no_gen["rounds"] == base["rounds"] and no_gen["method"] == "kdia"
    assert cell["client"]["epochs"] == 5 and base["rounds"] == 50


def test_a_strict_claim_fails_on_a_tie_and_a_plain_one_holds():
    from hetfl.reproduce.report import _holds

    paper = load_paper("kdia")
    name = cell_config(paper, "mnist", "0.5", 0, "ablation")["name"]
    cells = {name: {"results": {"kdia": {"final": 90.0}, "kdia_no_kd": {"final": 90.0},
                                "kdia_no_gen": {"final": 89.0}}}}
    claim = {"kind": "compare", "a": "kdia", "b": "kdia_no_kd"}
    assert _holds(paper, cells, "mnist", "ablation", claim) == "β=0.5: yes (90.00 vs 90.00)"
    assert _holds(paper, cells, "mnist", "ablation", {**claim, "strict": True}) == "β=0.5: no (90.00 vs 90.00)"
    strict_gen = {**claim, "b": "kdia_no_gen", "strict": True}
    assert _holds(paper, cells, "mnist", "ablation", strict_gen) == "β=0.5: yes (90.00 vs 89.00)"
    assert _holds(paper, cells, "fmnist", "ablation", claim) == "-"


@pytest.mark.slow
def test_hfldd_smoke_budget_runs_every_method(tmp_path):
    page = tmp_path / "page" / "hfldd.md"
    assert main(["reproduce", "hfldd", "--budget", "smoke", "--out", str(tmp_path / "runs"), "--results", str(page),
                 "--no-cache", "--quiet", "--save"]) == 0
    summary = json.loads((tmp_path / "runs" / "hfldd-synthetic-c2-s0-smoke" / "summary.json").read_text())
    results = summary["results"]
    assert set(results) == {"hfldd", "hfldd_nodd", "fedavg", "fedprox", "fedseq", "dynafed", "central"}
    assert results["hfldd"]["bytes_peer"] > 0 and results["fedavg"]["bytes_peer"] == 0
    text = page.read_text()
    assert "| C=2 | HFLDD |" in text
    assert "Fig. 6 (Synthetic (the smoke budget), C=2)" in text and "| method | to 50 % |" in text  # MiB to targets
    archived = json.loads((tmp_path / "page" / "hfldd-runs.json").read_text())["hfldd-synthetic-c2-s0-smoke"]
    curve, mib = archived["results"]["fedavg"]["curve"], archived["results"]["fedavg"]["mib"]
    assert len(mib) == len(curve) and mib == sorted(mib) and mib[-1] > 0  # cumulative tensor MiB per evaluation
    assert archived["results"]["hfldd"]["clusters"]["homogeneous"] == 2
    assert "Clusters found" in text and "(hfldd-synthetic-c2-s0-smoke-clusters.png)" in text
    assert (tmp_path / "page" / "hfldd-synthetic-c2-s0-smoke-clusters.png").is_file()


TINY_PAPER = {
    "title": "Tiny", "source": "none", "cell_name": "tiny-{dataset}-{setting}-s{seed}-{budget}", "metric": "best",
    "ours": "ensemble", "paper_method": "ensemble", "baselines": ["fedavg"], "datasets": {"synthetic": "Synthetic"},
    "settings": {"0.5": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5},
                 "2c/c": {"kind": "classes", "per_client": 2}},
    "seeds": [0, 1], "default_budget": "quick", "protocol": "3 clients.",
    "config": {"clients": 3, "data": {"train_per_class": 40, "test_per_class": 20, "size": 16, "classes": 4},
               "client": {"model": "cnn2", "epochs": "${epochs}", "batch_size": 32, "lr": 0.1}},
    "methods": {"fedavg": {}, "ensemble": {}, "twice": {"method": "fedavg", "rounds": 2}},
    "labels": {"fedavg": "FedAvg"}, "budgets": {"quick": {"about": "one epoch", "epochs": 1,
                                                          "methods": ["fedavg", "ensemble"]}},
    "published": {"synthetic": {"fedavg": [50.0, 40.0]}},
}


def test_a_cell_stopped_in_a_method_keeps_the_results_of_earlier_runs(tmp_path, monkeypatch):
    from hetfl.engine.simulator import Simulator

    paper = Paper("tiny", TINY_PAPER)
    root = tmp_path / "runs"
    one = grid(paper, "quick", ["synthetic"], ["0.5"], [0], methods=["fedavg"])
    run_cell(one[0], root, None, None, "cpu", 1, True)
    minutes = json.loads((root / one[0]["name"] / "summary.json").read_text())["minutes"]
    original = Simulator.run_method

    def stop(self, name):  # noqa: ANN001, ANN202
        if name == "twice":
            raise KeyboardInterrupt
        return original(self, name)

    monkeypatch.setattr(Simulator, "run_method", stop)
    three = grid(paper, "quick", ["synthetic"], ["0.5"], [0], methods=["fedavg", "ensemble", "twice"])
    with pytest.raises(KeyboardInterrupt):
        run_cell(three[0], root, None, None, "cpu", 1, True)
    summary = json.loads((root / three[0]["name"] / "summary.json").read_text())
    assert list(summary["results"]) == ["fedavg", "ensemble"]  # the first run's fedavg is still there
    assert set(summary["config"]["methods"]) == {"fedavg", "ensemble", "twice"}  # and its settings
    assert summary["minutes"] > minutes  # the first run's minutes and the stopped run's so far


def test_grid_runs_skips_finished_cells_and_adds_a_method_to_a_cell(tmp_path, capsys):
    paper = Paper("tiny", TINY_PAPER)
    root, cache = tmp_path / "runs", tmp_path / "cache"
    cells = grid(paper, "quick", ["synthetic"], ["0.5", "2c/c"], [0, 1])
    assert run_grid(cells[:1], root, cache, None, "cpu", 1, True) == []
    first = json.loads((root / cells[0]["name"] / "summary.json").read_text())
    assert list(first["results"]) == ["fedavg", "ensemble"] and first["minutes"] > 0
    assert run_grid(cells, root, cache, None, "cpu", 2, True) == []  # two jobs; the finished cell is skipped
    assert "1 of 4 cells finished; 3 to run" in capsys.readouterr().out
    assert (root / cells[0]["name"] / "summary.json").read_text() == json.dumps(first, indent=1)
    more = grid(paper, "quick", ["synthetic"], ["0.5"], [0], methods=["fedavg", "ensemble", "twice"])
    assert finished(root / more[0]["name"], list(more[0]["methods"])) is None
    run_grid(more, root, cache, None, "cpu", 1, True)
    merged = json.loads((root / more[0]["name"] / "summary.json").read_text())
    assert list(merged["results"]) == ["fedavg", "ensemble", "twice"]
    assert merged["results"]["fedavg"] == first["results"]["fedavg"]  # the earlier results are kept
    assert merged["results"]["twice"]["method"] == "fedavg"
    page = tmp_path / "tiny.md"
    write_results(paper, root, page, tmp_path / "tiny-runs.json")
    text = page.read_text()
    assert "| FedAvg | " in text and "| 50.00 |" in text and "(n=2)" in text
    small = condense(merged, root / more[0]["name"])
    assert set(small["results"]["twice"]) >= {"method", "final", "best", "curve"}  # two rounds: a curve


def test_cells_get_threads_from_the_cpus_this_process_may_use(monkeypatch):
    from hetfl.reproduce import runner

    monkeypatch.setattr(runner.os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert runner.usable_cpus() == 1  # e.g. under `taskset -c 3`, whatever os.cpu_count() says


def test_a_cell_run_in_parts_keeps_the_archived_methods_it_did_not_run(tmp_path):
    """The archive holds fedavg and ensemble of a cell; a fresh runs folder has fedavg again and twice:
    the page and the archive keep ensemble, take the new fedavg and twice, and add up the minutes."""
    from hetfl.reproduce.report import load_cells
    from hetfl.reproduce.runner import save_archive

    paper = Paper("tiny", TINY_PAPER)
    name = grid(paper, "quick", ["synthetic"], ["0.5"], [0])[0]["name"]
    archive = tmp_path / "tiny-runs.json"
    old = {"results": {"fedavg": {"method": "fedavg", "final": 1.0, "best": 1.0, "seconds": 60.0},
                       "ensemble": {"method": "ensemble", "final": 2.0, "best": 2.0}},
           "minutes": 10.0, "machine": "an old CPU"}
    archive.write_text(json.dumps({name: old}))
    root = tmp_path / "runs"
    more = grid(paper, "quick", ["synthetic"], ["0.5"], [0], methods=["fedavg", "twice"])
    run_grid(more, root, None, None, "cpu", 1, True)
    new = condense(json.loads((root / name / "summary.json").read_text()), root / name)
    for cells in (load_cells(root, archive), (save_archive(paper, root, archive), json.loads(archive.read_text()))[1]):
        cell = cells[name]
        assert set(cell["results"]) == {"fedavg", "ensemble", "twice"}
        assert cell["results"]["ensemble"] == old["results"]["ensemble"]
        assert cell["results"]["fedavg"] == new["results"]["fedavg"]
        assert cell["minutes"] == round(10.0 + new["minutes"] - 1.0, 1)  # less the fedavg run again
        assert cell["machine"] == f"an old CPU and {new['machine']}"
    assert load_cells(root, tmp_path / "none.json")[name] == new  # nothing archived: the runs folder's cell


def finished_tiny_cell(tmp_path: Path) -> tuple[Paper, Path, dict, Path]:
    """The tiny paper, its runs folder, and one cell run to the end there (fedavg, ensemble), with the
    path of its summary.json."""
    paper = Paper("tiny", TINY_PAPER)
    root = tmp_path / "runs"
    cell = grid(paper, "quick", ["synthetic"], ["0.5"], [0])[0]
    run_grid([cell], root, None, None, "cpu", 1, True)
    return paper, root, cell, root / cell["name"] / "summary.json"


def test_a_stopped_cell_stays_off_the_page_and_saves_only_what_it_finished(tmp_path, capsys):
    """A cell of the runs folder that lacks a result for one of its methods (a grid stopped mid-cell)
    does not reach the page; ``--save`` puts the methods it finished into the archived cell of its name
    (which stays whole), and archives nothing where no whole cell is archived; once finished, it does."""
    from hetfl.reproduce.report import load_cells
    from hetfl.reproduce.runner import save_archive

    paper, root, cell, path = finished_tiny_cell(tmp_path)
    whole = json.loads(path.read_text())
    stopped = {**whole, "results": {"fedavg": whole["results"]["fedavg"]}}
    path.write_text(json.dumps(stopped))
    archive = tmp_path / "tiny-runs.json"
    old = {"results": {"fedavg": {"method": "fedavg", "final": 1.0, "best": 1.0},
                       "ensemble": {"method": "ensemble", "final": 2.0, "best": 2.0}},
           "minutes": 10.0, "machine": "an old CPU"}
    archive.write_text(json.dumps({cell["name"]: old}))
    assert load_cells(root, archive) == {cell["name"]: old}
    assert load_cells(root, tmp_path / "none.json") == {}
    assert save_archive(paper, root, tmp_path / "empty.json") == 0
    assert json.loads((tmp_path / "empty.json").read_text()) == {}
    assert f"not archived: {cell['name']} has no result yet for ensemble" in capsys.readouterr().out
    assert save_archive(paper, root, archive) == 1
    saved = json.loads(archive.read_text())[cell["name"]]["results"]
    assert saved["ensemble"] == old["results"]["ensemble"]
    assert saved["fedavg"] == condense(stopped, path.parent)["results"]["fedavg"]
    assert f"{cell['name']}: archived fedavg; ensemble stay as archived" in capsys.readouterr().out
    path.write_text(json.dumps(whole))
    assert load_cells(root, archive)[cell["name"]] == condense(whole, path.parent)


def test_rerun_runs_a_finished_method_again_and_drops_its_old_minutes(tmp_path, monkeypatch, capsys):
    from hetfl.reproduce import runner
    from hetfl.reproduce.runner import drop_results

    paper, root, cell, path = finished_tiny_cell(tmp_path)
    before = json.loads(path.read_text())
    before["minutes"] = 5.0
    before["results"]["ensemble"]["seconds"] = 60.0
    path.write_text(json.dumps(before))
    monkeypatch.setattr(runner, "load_paper", lambda name: paper)
    args = argparse.Namespace(paper="tiny", budget=None, ablation=False, jobs=1, out=str(root),
                              results=str(tmp_path / "tiny.md"), report_only=False, datasets="synthetic",
                              settings="0.5", seeds="0", methods=None, rerun="ensemble", no_cache=True,
                              cache_dir=None, data_root=None, device="cpu", quiet=True, save=False)
    runner.main(args)
    assert f"{cell['name']}: running ensemble again" in capsys.readouterr().out
    after = json.loads(path.read_text())
    assert after["results"]["fedavg"] == before["results"]["fedavg"]  # not asked: kept
    assert after["results"]["ensemble"]["seconds"] != 60.0  # run again
    assert 4.0 < after["minutes"] < 5.0 + 1.0  # 5 less the old ensemble's minute, plus the rerun's time
    assert drop_results(root / cell["name"], ["twice"]) == []  # no result: nothing to drop
    assert drop_results(tmp_path / "nowhere", ["fedavg"]) == []
    with pytest.raises(ConfigError, match="--rerun: unknown"):
        runner.main(argparse.Namespace(**{**vars(args), "rerun": "nope"}))


def test_save_archives_only_cells_with_every_method_done(tmp_path, capsys):
    from hetfl.reproduce.runner import save_archive

    paper, root, cell, path = finished_tiny_cell(tmp_path)
    summary = json.loads(path.read_text())
    del summary["results"]["ensemble"]  # as a cell stopped before its last method
    path.write_text(json.dumps(summary))
    archive = tmp_path / "tiny-runs.json"
    assert save_archive(paper, root, archive) == 0 and json.loads(archive.read_text()) == {}
    assert f"not archived: {cell['name']} has no result yet for ensemble" in capsys.readouterr().out


def test_the_page_counts_the_uploads_a_method_left_out(tmp_path):
    paper = load_paper("kdia")
    entry = {"method": "fedavg", "accuracy": 50.0, "best_accuracy": 60.0, "seconds": 10.0, "bytes_up": 1,
             "bytes_down": 1, "params": {"rounds": 2}}
    summary = {"config": {"methods": {"fedavg": {"rounds": 2}, "fedcog": {"rounds": 2}}}, "minutes": 1.0,
               "results": {"fedavg": entry, "fedcog": {**entry, "method": "fedcog", "client_failures": [
                   {"round": 2, "client": 4, "reason": "upload rejected: NaN"}]}},
               "curves": {"fedavg": [[1, 40.0], [2, 60.0]], "fedcog": [[1, 40.0], [2, 50.0]]}}
    cell = condense(summary)
    assert cell["results"]["fedcog"]["left_out"] == 1 and "left_out" not in cell["results"]["fedavg"]
    archive = tmp_path / "kdia-runs.json"
    archive.write_text(json.dumps({cell_config(paper, "mnist", "0.1", 0, "reduced")["name"]: cell}))
    write_results(paper, tmp_path / "no-runs", tmp_path / "kdia.md", archive)
    assert "left out of their round" in (text := (tmp_path / "kdia.md").read_text())
    assert "FedCOG at β=0.1: 1 in 1 cell." in text


@pytest.mark.parametrize("name", ["fedhydra", "fedmho", "kdia", "hfldd"])
def test_the_protocol_line_states_the_optimiser_the_cells_ran_with(name):
    """The page's optimiser is the config's, resolved; a cell that ran with another is marked and named."""
    from hetfl.reproduce.report import STALE, configured_optimiser, protocol_optimiser, stale_rows

    paper = load_paper(name)
    page = (RESULTS / f"{name}.md").read_text()
    assert protocol_optimiser(paper, paper.default_budget) in page.splitlines()[4]  # the protocol line
    cells = json.loads((RESULTS / f"{name}-runs.json").read_text())
    stale = {(cell, label) for cell, label, _ in stale_rows(paper, cells)}
    keys = {cell_config(paper, d, s, seed, b)["name"]: (d, s, seed, b) for b in paper.budgets
            for d in paper.datasets for s in paper.settings for seed in range(3)}
    for cell, entry in cells.items():
        for label, result in entry["results"].items():
            assert "optimiser" in result, f"{cell} {label} records no optimiser"
            if label in paper.methods and cell in keys and (cell, label) not in stale:
                cfg = cell_config(paper, *keys[cell], methods=[label])
                assert result["optimiser"] == configured_optimiser(cfg, label), (cell, label)
    if stale:
        assert f"{STALE} Not yet re-run" in page
        assert all(cell in page for cell, _ in stale)


def test_a_result_run_with_another_optimiser_is_marked_on_the_page(tmp_path):
    paper = Paper("tiny", TINY_PAPER)
    name = grid(paper, "quick", ["synthetic"], ["0.5"], [0])[0]["name"]
    resolved = {"lr": 0.1, "momentum": 0.0, "weight_decay": 0.0}
    archive = tmp_path / "tiny-runs.json"
    archive.write_text(json.dumps({name: {"results": {
        "fedavg": {"method": "fedavg", "final": 1.0, "best": 1.0, "optimiser": {**resolved, "momentum": 0.9}},
        "ensemble": {"method": "ensemble", "final": 2.0, "best": 2.0, "optimiser": resolved}},
        "minutes": 1.0, "machine": "a CPU"}}))
    page = tmp_path / "tiny.md"
    write_results(paper, tmp_path / "runs", page, archive)
    text = page.read_text()
    assert "Client optimiser (resolved from the config): SGD lr 0.1, momentum 0, weight decay 0." in text
    assert "| FedAvg | 1.00 (n=1) † |" in text and "| ensemble | 2.00 (n=1) |" in text
    assert f"FedAvg in {name} (SGD lr 0.1, momentum 0.9, weight decay 0)" in text


def test_a_budgets_method_overrides_add_no_method_the_cell_left_out():
    cell = cell_config(load_paper("kdia"), "synthetic", "0.5", 0, "smoke", ["fedavg"])  # smoke overrides fedcog
    assert list(cell["methods"]) == ["fedavg"]


def test_the_frontier_smoke_grid_draws_every_method_on_bytes_and_regenerates_from_its_archive(tmp_path):
    page = tmp_path / "page" / "frontier.md"
    runs = ["reproduce", "frontier", "--budget", "smoke", "--out", str(tmp_path / "runs"), "--results", str(page),
            "--no-cache", "--quiet"]
    assert main([*runs, "--save"]) == 0
    text = page.read_text()
    assert "#### Synthetic (the smoke budget), Dirichlet(0.5), seed 0" in text
    assert "| byte budget | best accuracy % (validation-picked) |" in text
    assert "the clients' training sample-passes in millions" in text  # a new run counts them
    assert (tmp_path / "page" / "frontier-smoke-synthetic.png").is_file()
    archived = json.loads((tmp_path / "page" / "frontier-runs.json").read_text())["frontier-synthetic-0.5-s0-smoke"]
    fronts = {label: r["front"] for label, r in archived["results"].items()}
    assert fronts["fedavg_oneshot"]["family"] == "one-shot" and len(fronts["fedavg_oneshot"]["points"]) == 1
    assert fronts["fedavg"]["family"] == "rounds" and [p[0] for p in fronts["fedavg"]["points"]] == [1, 2, 3]
    first = text
    assert main(["reproduce", "frontier", "--report-only", "--out", str(tmp_path / "no-runs"), "--results",
                 str(page)]) == 0
    assert page.read_text() == first  # the archive alone gives the same page


def test_the_frontier_cost_table_adds_sample_passes_only_for_the_cells_that_counted_them():
    from hetfl.frontier import Curve, Panel, Point
    from hetfl.reproduce.frontier_page import cost_table

    def panel(title: str, passes: int | None) -> Panel:
        point = Point(bytes=1, accuracy=50.0, round=3, seconds=90.0, client_seconds=60.0, server=30.0,
                      client_passes=passes)
        return Panel(key=(title,), title=title, selection="val", curves=[Curve("run", "FedAvg", "rounds", [point])])

    old = cost_table([("old", panel("old", None))])
    assert old[-2] == "| FedAvg | 1.0 / 0.5 |" and "sample-passes" not in old[2]
    both = cost_table([("old", panel("old", None)), ("new", panel("new", 2_345_678))])
    assert both[-2] == "| FedAvg | 1.0 / 0.5 | 1.0 / 0.5 / 2.35M |" and "sample-passes in millions" in both[2]
    assert cost_table([("new", panel("new", 2_345_678))])[-3] == "|---|---|"
