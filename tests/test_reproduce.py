import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetfl.methods.checks import validate
from hetfl.reproduce import fedhydra as paper


def test_every_cell_of_the_grid_is_a_valid_config_with_a_unique_name():
    cells = paper.grid(list(paper.DATASETS), list(paper.SETTINGS), [0, 1, 2], "reduced", paper.METHODS,
                       [5, 10], ablation=True)
    assert len(cells) == 2 * 5 * 3 * 2 + 2 * 3 * 5
    assert len({c["name"] for c in cells}) == len(cells)
    for cfg in cells[:12] + cells[-6:]:
        validate(cfg)
    c = paper.cell_config("mnist", "2c/c", 1, "paper")
    assert c["partition"] == {"kind": "2c/c"} and c["client"]["epochs"] == 200
    assert c["methods"]["fedhydra"]["epochs"] == 200 and c["methods"]["fedhydra"]["generator_steps"] == 30
    assert list(c["methods"]) == ["ensemble", *paper.METHODS, "fedhydra_log1p", "fedhydra_replay", "fedhydra_dense",
                                  "fedhydra_dense_log1p"]


def fake_summary(root, dataset, setting, seed, accs, budget="reduced"):
    cfg = paper.cell_config(dataset, setting, seed, budget)
    out = root / cfg["name"]
    out.mkdir(parents=True, exist_ok=True)
    results = {m: {"accuracy": a - 1, "best_accuracy": a} for m, a in accs.items()}
    (out / "summary.json").write_text(json.dumps({"config": cfg, "results": results, "minutes": 2.0}))
    return cfg


SHUFFLED = ("dense", "fedhydra_dense", "fedhydra_dense_log1p")  # pool_shuffle by default since session 66


def shuffled(method, result):
    """``result`` as a run of ``method`` records it since its KD batches are reshuffled by default (the
    params a result of the older defaults lacks: common.CHANGED_DEFAULTS); other methods' as given."""
    return {**result, "params": {"pool_shuffle": True}} if method in SHUFFLED else result


def test_report_means_paper_numbers_and_ordering(tmp_path):
    base = dict.fromkeys(("ensemble", *paper.METHODS), 40.0)
    fake_summary(tmp_path, "mnist", "0.1", 0, {**base, "fedhydra": 60.0})
    fake_summary(tmp_path, "mnist", "0.1", 1, {**base, "fedhydra": 62.0})
    low = dict.fromkeys(("ensemble", *paper.METHODS), 20.0)
    fake_summary(tmp_path, "mnist", "2c/c", 0, {**low, "fedhydra": 30.0, "coboosting": 35.0})
    text = paper.report(tmp_path, "reduced")
    fedhydra_row = next(line for line in text.splitlines() if line.startswith("| FedHydra"))
    assert "61.00 ± 1.41 (60.00 ± 1.41) n=2 | 59.97" in fedhydra_row  # ours beside Table 1
    assert "30.00 (29.00) n=1 | 40.81" in fedhydra_row  # Table 2
    assert "not run" in fedhydra_row
    assert "0.1 (n=2): FedHydra first (61.00 vs best baseline 40.00)" in text
    assert "2c/c (n=1): FedHydra below Co-Boosting" in text
    # the final epoch is ranked as well: a collapse after a good epoch is not hidden
    fake_summary(tmp_path, "fmnist", "0.1", 0, {**base, "fedhydra": 60.0})
    summary = tmp_path / paper.cell_config("fmnist", "0.1", 0, "reduced")["name"] / "summary.json"
    data = json.loads(summary.read_text())
    data["results"]["fedhydra"]["accuracy"] = 10.0
    summary.write_text(json.dumps(data))
    assert ("0.1 (n=1): FedHydra first (60.00 vs best baseline 40.00); "
            "final epoch: FedHydra below FedAvg (10.00 vs best baseline 39.00)") in paper.report(tmp_path, "reduced")
    paper.write_results(tmp_path, tmp_path / "out.md")
    assert (tmp_path / "out.md").read_text().startswith("# FedHydra reproduction")



def test_ordering_names_the_baselines_it_could_not_compare(tmp_path):
    fake_summary(tmp_path, "mnist", "0.1", 0, {"ensemble": 60.0, "fedavg": 50.0, "dense": 58.0, "fedhydra": 66.0},
                 budget="paper")
    summary = tmp_path / paper.cell_config("mnist", "0.1", 0, "paper")["name"] / "summary.json"
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "environment": {"device": "cuda"}}))
    text = paper.report(tmp_path, "paper")
    assert "Minutes per cell (all methods, incl. local training): 2.00 over 1 cells on cuda." in text
    assert ("0.1 (n=1): FedHydra first (66.00 vs best baseline 58.00); "
            "final epoch: FedHydra first (65.00 vs best baseline 57.00); "
            "not compared: OT, FedDF, Co-Boosting (not run in every cell)") in text

def test_budget_section_states_our_variants_place_where_fedhydra_as_specified_did_not_run(tmp_path):
    accs = {"ensemble": 48.0, "fedavg": 38.0, "dense": 61.0, "fedhydra_dense_log1p": 74.0}
    fake_summary(tmp_path, "fmnist", "0.1", 0, accs, budget="paper")
    text = paper.report(tmp_path, "paper")
    assert "Ordering under strong heterogeneity: no complete cells yet" in text  # FedHydra as specified
    assert "Ordering under strong heterogeneity, `fedhydra_dense_log1p` (best over epochs, then final epoch):" in text
    assert ("- 0.1 (n=1): `fedhydra_dense_log1p` first (74.00 vs best baseline 61.00); final epoch: "
            "`fedhydra_dense_log1p` first (73.00 vs best baseline 60.00)") in text
    # where FedHydra as specified ran in every cell, its line alone (our variants: the one-cache section)
    fake_summary(tmp_path, "fmnist", "0.1", 0, {**accs, "fedhydra": 50.0}, budget="paper")
    assert "`fedhydra_dense_log1p` (best" not in paper.report(tmp_path, "paper")


def test_ablation_table_takes_the_paper_row_from_the_main_cell_of_the_same_seeds(tmp_path):
    base = dict.fromkeys(("ensemble", *paper.METHODS), 40.0)
    fake_summary(tmp_path, "mnist", "0.5", 0, {**base, "fedhydra": 70.0})
    fake_summary(tmp_path, "mnist", "0.5", 1, {**base, "fedhydra": 10.0})  # no ablation at seed 1
    for lambdas, acc in [((0.0, 1.0), 50.0), ((1.0, 0.0), 60.0)]:
        cfg = paper.cell_config("mnist", "0.5", 0, "reduced", ("fedhydra",), 5, lambdas)
        (tmp_path / cfg["name"]).mkdir()
        (tmp_path / cfg["name"] / "summary.json").write_text(json.dumps(
            {"config": cfg, "results": {"fedhydra": {"accuracy": acc - 5, "best_accuracy": acc}}}))
    lines = paper.report(tmp_path, "reduced").splitlines()
    rows = {prefix: next(line for line in lines if line.startswith(prefix))
            for prefix in ("| 1 | 1 |", "| 0 | 1 |", "| 1 | 0 |", "| 0.5 | 1 |")}
    assert "70.00 (69.00) n=1 | 88.75" in rows["| 1 | 1 |"]
    assert "50.00 (45.00) n=1 | 83.29" in rows["| 0 | 1 |"]
    assert "60.00 (55.00) n=1 | 76.19" in rows["| 1 | 0 |"]
    assert "not run | 84.61" in rows["| 0.5 | 1 |"] and "not run | 76.72" in rows["| 0.5 | 1 |"]


@pytest.mark.parametrize("method", ["fedhydra_dense", "fedhydra_dense_log1p"])
def test_ablation_in_denses_loop_runs_all_six_rows_and_reports_its_own_table(tmp_path, method):
    cells = paper.grid(["mnist"], [], [0], "reduced", paper.METHODS, [5], ablation=True,
                       ablation_method=method)
    assert len(cells) == len(paper.ABLATION) and len({c["name"] for c in cells}) == len(cells)
    for cfg in cells:
        assert list(cfg["methods"]) == ["ensemble", method] and cfg["name"].endswith("-reduced")
        assert "lambda_bn" in cfg["methods"][method] and f"-{method}-" in cfg["name"]
        validate(cfg)
    with pytest.raises(ValueError, match="the Table 6 ablation runs one of"):
        paper.grid(["mnist"], [], [0], "reduced", paper.METHODS, [5], ablation=True, ablation_method="dense")
    base = dict.fromkeys(("ensemble", *paper.METHODS), 40.0)
    fake_summary(tmp_path, "mnist", "0.5", 0, {**base, "fedhydra": 70.0, method: 99.0})
    for cfg, acc in zip(cells[:2], (30.0, 20.0)):  # rows (1, 1) and (0.5, 1)
        (tmp_path / cfg["name"]).mkdir()
        (tmp_path / cfg["name"] / "summary.json").write_text(json.dumps(
            {"config": cfg, "results": {method: {"accuracy": acc - 5, "best_accuracy": acc}}}))
    text = paper.report(tmp_path, "reduced")
    assert f"### Table 6 ablation (`{method}`, ours: FedHydra in DENSE's loop" in text
    assert text.count("### Table 6 ablation") == 1  # only the method that ran has a table
    assert "### Table 6 ablation (FedHydra," not in text  # no fedhydra ablation cells: no such table
    lines = text.splitlines()
    assert "30.00 (25.00) n=1 | 88.75" in next(x for x in lines if x.startswith("| 1 | 1 |"))  # its own cell
    assert "20.00 (15.00) n=1 | 84.61" in next(x for x in lines if x.startswith("| 0.5 | 1 |"))


def test_epoch_curves_dedupe_resumed_epochs_and_plot_one_figure_per_dataset(tmp_path):
    base = dict.fromkeys(("ensemble", *paper.METHODS), 40.0)
    cfg = fake_summary(tmp_path, "mnist", "0.1", 0, base)
    rows = [{"method": "fedavg", "step": -1, "final": True, "accuracy": 40.0}]
    rows += [{"method": "dense", "step": e, "accuracy": 10.0 * e} for e in (1, 2, 3)]
    rows += [{"method": "dense", "step": 3, "accuracy": 33.0}]  # a resumed stage logs its last epoch again
    rows += [{"method": "fedhydra", "step": e, "accuracy": 5.0 + e} for e in (2, 1)]
    (tmp_path / cfg["name"] / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    summary = json.loads((tmp_path / cfg["name"] / "summary.json").read_text())
    assert paper.epoch_curves(tmp_path, summary) == {"dense": [10.0, 20.0, 33.0], "fedhydra": [6.0, 7.0]}
    written = paper.plot_curves(tmp_path, tmp_path / "out.md", "reduced")
    assert [p.name for p in written] == ["out-curves-mnist-reduced.png"] and written[0].stat().st_size > 0
    import matplotlib.image
    assert matplotlib.image.imread(written[0]).shape[1] >= 700  # one panel: still wide enough for title and legend
    paper.write_results(tmp_path, tmp_path / "out.md")
    assert "![out-curves-mnist-reduced](out-curves-mnist-reduced.png)" in (tmp_path / "out.md").read_text()
    assert paper.plot_curves(tmp_path, tmp_path / "out.md", "paper") == []  # no cell at that budget


def test_finished_cells_are_skipped(tmp_path):
    methods = paper.cell_config("fmnist", "0.5", 0, "reduced")["methods"]
    cfg = fake_summary(tmp_path, "fmnist", "0.5", 0, dict.fromkeys(methods, 70.0))

    def runner(*args):
        raise AssertionError("a finished cell must not run again")

    summary = paper.run_cell(cfg, tmp_path, tmp_path / "cache", None, runner)
    assert summary["results"]["fedhydra"]["best_accuracy"] == 70.0


@pytest.mark.parametrize("paper_name", ["fedhydra", "fedmho"])
@pytest.mark.parametrize(("option", "value", "says"), [
    ("--settings", "0.5,0.7", "--settings: unknown '0.7'; choose from 0.5, 0.3, 0.1"),
    ("--budget", "nope", "--budget: unknown 'nope'; choose from paper, reduced, "),
    ("--methods", "fedavg,nosuch", "--methods: unknown 'nosuch'; choose from fedavg, "),
    ("--seeds", "0,x", "--seeds: expected comma-separated integers such as 0,1,2, got '0,x'"),
])
def test_cli_names_the_option_and_value_it_rejects(capsys, tmp_path, paper_name, option, value, says):
    from hetfl.cli import main

    assert main(["reproduce", paper_name, option, value, "--out", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("--") == 1  # only the bad option, not every option
    assert not (tmp_path / "runs").exists()  # nothing ran


@pytest.mark.parametrize("budget", list(paper.BUDGETS))
def test_budgets_define_every_key(budget):
    # optional: fp32 (server and clients) and the method defaults unless given
    keys = set(paper.BUDGETS[budget]) - {"precision", "client_precision", "ours"}
    assert keys == {"client_epochs", "epochs", "generator_steps", "batch_size", "strat_batch_size", "feddf_steps"}
    assert paper.precision(budget) in ("fp32", "bf16")


def test_paper_budget_runs_our_variant_at_temperature_20_and_the_reduced_budgets_at_its_default():
    from hetfl.methods import fedhydra as fh

    cfg = paper.cell_config("fmnist", "0.5", 0, "paper")
    assert cfg["methods"][paper.VARIANT]["temperature"] == 20.0
    assert "temperature" not in cfg["methods"]["fedhydra"] and "temperature" not in cfg["methods"]["dense"]
    for budget in ("reduced", "reduced-t60", "reduced-t60-g30"):
        assert "temperature" not in paper.cell_config("fmnist", "0.5", 0, budget)["methods"][paper.VARIANT]
    assert fh.FedHydraDenseLoopLog1p.method_defaults["temperature"] == 1.0  # what those cells ran with



@pytest.mark.parametrize("which", ["fedhydra", "fedmho"])
def test_reproduce_device_flag_reaches_every_cell(tmp_path, monkeypatch, which):
    from hetfl.cli import main
    from hetfl.reproduce import common
    from hetfl.reproduce import fedmho as mho

    seen = []

    def fake_run_cell(cfg, root, cache, data_root, runner):
        seen.append(cfg["device"])
        return {}

    monkeypatch.setattr(paper, "run_cell", fake_run_cell)
    monkeypatch.setattr(mho, "run_cell", fake_run_cell)
    monkeypatch.setattr(common, "run_cell", fake_run_cell)
    args = ["reproduce", which, "--datasets", "mnist", "--settings", "0.1", "--seeds", "0,1", "--device", "cuda:1",
            "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "out.md"), "--quiet"]
    assert main(args) == 0
    assert seen == ["cuda:1", "cuda:1"]

def test_adding_a_method_to_a_finished_cell_runs_only_that_method(tmp_path, monkeypatch):
    from hetfl.engine.simulator import Simulator
    from hetfl.methods.checks import validate
    from hetfl.reproduce.common import run_missing_methods

    base = {"name": "cell", "seed": 0, "dataset": "synthetic",
            "data": {"train_per_class": 30, "test_per_class": 10, "size": 16, "classes": 4},
            "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5}, "clients": 3,
            "client": {"model": "cnn2", "epochs": 1, "batch_size": 32, "lr": 0.1}}
    ran: list[list[str]] = []
    original = Simulator.run

    def spy(self):
        ran.append(sorted(self.exp.cfg["methods"]))
        return original(self)

    monkeypatch.setattr(Simulator, "run", spy)
    first = run_missing_methods(validate({**base, "methods": {"fedavg": {}}}), tmp_path, tmp_path / "cache", None, True)
    both = run_missing_methods(validate({**base, "methods": {"fedavg": {}, "ensemble": {}}}), tmp_path,
                               tmp_path / "cache", None, True)
    again = run_missing_methods(validate({**base, "methods": {"fedavg": {}, "ensemble": {}}}), tmp_path,
                                tmp_path / "cache", None, True)
    assert ran == [["fedavg"], ["ensemble"]]  # the third call finds both methods finished
    assert both["results"]["fedavg"] == first["results"]["fedavg"]
    assert set(both["results"]) == set(again["results"]) == {"fedavg", "ensemble"}
    assert first["uploads_trained"] == 3  # the cell trained its 3 clients' uploads; the ensemble read them
    assert both["uploads_trained"] == again["uploads_trained"] == 3  # kept when methods join the cell
    elsewhere = run_missing_methods(validate({**base, "methods": {"fedavg": {}}}), tmp_path / "b",
                                    tmp_path / "cache", None, True)
    assert "uploads_trained" not in elsewhere  # every upload from a cache another cell filled


def test_minutes_note_counts_cached_cells_only_where_the_cell_trained_no_upload():
    from hetfl.reproduce.fedmho import _all_cached

    read = {"config": {"clients": 2}, "results": {"fedavg": {"cached_uploads": 2}, "fedmho": {"cached_uploads": 2}}}
    assert _all_cached(read)
    assert not _all_cached({**read, "uploads_trained": 12})  # its clients' job trained them (--jobs)
    assert not _all_cached({**read, "results": {**read["results"], "fedavg": {"cached_uploads": 1}}})


def test_a_cell_run_before_a_schema_key_existed_keeps_its_methods():
    from hetfl.methods.checks import validate
    from hetfl.reproduce.common import same_setting

    cfg = validate({"name": "cell", "seed": 0, "dataset": "synthetic", "clients": 3,
                    "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5}, "methods": {"fedavg": {}}})
    older = {k: v for k, v in cfg.items() if k not in ("flower", "min_clients")}  # written before those keys
    assert same_setting(older, cfg)
    assert not same_setting(older, {**cfg, "min_clients": 2})  # a non-default value is a different setting
    assert not same_setting({**older, "seed": 1}, cfg)
    assert not same_setting({**cfg, "extra": 1}, cfg)


def test_cell_minutes_include_the_earlier_runs_of_the_cell(tmp_path):
    cfg = fake_summary(tmp_path, "mnist", "0.5", 0, dict.fromkeys(("ensemble", *paper.METHODS), 50.0))
    path = tmp_path / cfg["name"] / "summary.json"
    summary = json.loads(path.read_text())
    path.write_text(json.dumps({**summary, "minutes": 3.0, "prior_minutes": 9.0}))  # a method added later
    text = paper.report(tmp_path, "reduced")
    assert "Minutes per cell (all methods, incl. local training): 12.00 over 1 cells." in text


def test_minutes_are_grouped_by_the_machine_that_ran_the_cells(tmp_path):
    """A GPU's minutes and 2 CPU cores' minutes are reported apart, each with the card or processor."""
    from hetfl.reproduce.common import machine_label, minutes_by_machine

    gpu = {"device": "cuda", "accelerator": "NVIDIA H100 80GB HBM3", "cpu": "Intel Xeon"}
    cpu = {"device": "cpu", "cpu": "AMD EPYC", "cpu_capability": "AVX512"}
    cells = [{"minutes": 8.0, "environment": gpu}, {"minutes": 17.0, "environment": cpu},
             {"minutes": 10.0, "prior_minutes": 2.0, "environment": gpu}, {"environment": cpu},
             {"minutes": 3.0, "environment": {"device": "cuda"}}]
    assert minutes_by_machine(cells) == [("cuda (NVIDIA H100 80GB HBM3)", [8.0, 12.0]),
                                         ("cpu (AMD EPYC, AVX512)", [17.0]), ("cuda", [3.0])]
    assert machine_label({}) == ""
    amx = {"device": "cpu", "cpu": "Intel(R) Xeon(R) Processor", "cpu_capability": "AVX512",
           "cpu_bf16": ["avx512_bf16", "amx_bf16"]}
    no_amx = {**amx, "cpu_bf16": []}
    assert machine_label({"environment": amx}) == "cpu (Intel(R) Xeon(R) Processor, AVX512, amx_bf16)"
    assert machine_label({"environment": no_amx}) == "cpu (Intel(R) Xeon(R) Processor, AVX512)"
    assert [label for label, _ in minutes_by_machine([{"minutes": 1.0, "environment": amx},
                                                      {"minutes": 2.0, "environment": no_amx}])] == [
        "cpu (Intel(R) Xeon(R) Processor, AVX512, amx_bf16)", "cpu (Intel(R) Xeon(R) Processor, AVX512)"]
    for seed, env in ((0, gpu), (1, cpu)):
        cfg = fake_summary(tmp_path, "mnist", "0.5", seed, dict.fromkeys(("ensemble", *paper.METHODS), 50.0))
        path = tmp_path / cfg["name"] / "summary.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "environment": env}))
    assert ("Minutes per cell (all methods, incl. local training): 2.00 over 1 cells on cuda (NVIDIA H100 80GB "
            "HBM3); 2.00 over 1 cells on cpu (AMD EPYC, AVX512).") in paper.report(tmp_path, "reduced")


def test_failure_note_names_left_out_clients_per_cell():
    from hetfl.reproduce.common import failure_note

    ok = {"config": {"name": "c-s0"}, "results": {"fedavg": {"accuracy": 90.0, "client_failures": []}}}
    assert failure_note([ok]) == ""
    bad = {"config": {"name": "c-s1"}, "results": {
        "fedmho": {"client_failures": [{"round": 0, "client": 5,
                                        "reason": "upload rejected: tensor 'net.0.bias' has NaN or inf values"}]},
        "fedmho_md": {"client_failures": [{"round": 0, "client": 5,
                                           "reason": "upload rejected: tensor 'net.2.weight' has NaN or inf values"}]},
        "fedavg": {}}}
    note = failure_note([ok, bad])
    # one entry per (cell, client, failure): the tensor names differ, the failure is the same
    assert note == ("Client failures (these methods ran without that client): c-s1: client 5 left out by "
                    "fedmho, fedmho_md (upload rejected: NaN or inf values).")


def test_reproduce_methods_help_lists_every_method_of_both_papers():
    from hetfl.cli import build_parser
    from hetfl.reproduce import fedmho

    rep = build_parser()._subparsers._group_actions[0].choices["reproduce"]
    text = next(a.help for a in rep._actions if "--methods" in a.option_strings)
    listed = set(text.replace(";", ",").replace(")", ",").replace(":", ",").replace(" ", ",").split(","))
    assert set(paper.METHODS + paper.EXTRA) <= listed and set(fedmho.LABELS) <= listed


def test_parallel_cells_give_the_sequential_results_and_resume_nothing_twice(tmp_path, tiny_config):
    """--jobs: clients first, then one worker process per method on the cached uploads; the merged
    cell equals the in-process run on the same cache and is archived once its last method is merged,
    and a second call finds nothing to do."""
    from hetfl.reproduce.common import archive_cell, cell_minutes, run_cell, run_cells_parallel, run_missing_methods

    gen = {"epochs": 2, "generator_steps": 2, "batch_size": 16}
    methods = {"ensemble": {}, "fedavg": {}, "dense": gen, "fedhydra": {**gen, "strat_batch_size": 4}}
    raw = {**tiny_config, "device": "cpu", "methods": methods}  # as the CLI's grid builds it
    cfg = validate(raw)
    cache = tmp_path / "cache"
    lines: list[str] = []
    archived: list[str] = []

    def archive(name: str) -> None:
        archived.append(name)
        archive_cell(tmp_path / "par", name, tmp_path / "archive", paper.CURVE_METHODS)

    failed = run_cells_parallel([raw], tmp_path / "par", cache, None, jobs=2, threads=2, say=lines.append,
                                done=archive)
    assert failed == [] and archived == ["tiny"]
    started = [line for line in lines if line.endswith("started")]
    assert started == ["tiny: ensemble,fedavg started", "tiny: dense started", "tiny: fedhydra started"]
    assert lines[1].startswith("tiny: ensemble,fedavg done")  # the clients' job ran alone, first
    par = json.loads((tmp_path / "par" / "tiny" / "summary.json").read_text())
    seq = run_cell(cfg, tmp_path / "seq", cache, None,
                   lambda c, out, cache_, root: run_missing_methods(c, out, cache_, root, True))
    assert set(par["results"]) == set(cfg["methods"]) == set(par["config"]["methods"])
    for m in cfg["methods"]:
        assert par["results"][m]["accuracy"] == seq["results"][m]["accuracy"], m
        assert seq["results"][m]["cached_uploads"] == 3  # the same uploads, from the cache
    assert par["results"]["dense"]["cached_uploads"] == par["results"]["fedhydra"]["cached_uploads"] == 3
    assert par["uploads_trained"] == 3 and "uploads_trained" not in seq  # the clients' job trained them
    assert (tmp_path / "par" / "tiny" / "fedhydra" / "stratification.json").is_file()
    rows = [json.loads(r) for r in (tmp_path / "par" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows} == set(cfg["methods"])
    assert not (tmp_path / "par" / ".parts" / "tiny" / "dense").exists()  # merged and removed
    assert cell_minutes(par) > 0  # the workers' minutes add up
    saved = json.loads((tmp_path / "archive" / "tiny.json").read_text())
    assert {k: v for k, v in saved.items() if k != "curves"} == par  # after the last merge
    assert set(saved["curves"]) == {"dense", "fedhydra"} and len(saved["curves"]["fedhydra"]) == 2
    lines.clear()
    assert run_cells_parallel([raw], tmp_path / "par", cache, None, jobs=2, say=lines.append,
                              done=archived.append) == [] and lines == []
    assert archived == ["tiny", "tiny"]  # a cell finished before the call is archived as well


def test_a_finished_worker_left_unmerged_by_a_stopped_parent_is_merged_once(tmp_path, tiny_config):
    """A deadline can stop the parent after a worker's method finished but before the merge: the
    next call (or merge_finished_parts alone, as scripts/device-cells.sh does) joins that part to the
    cell instead of running the method again; an unfinished part or other parameters stay apart."""
    from hetfl.reproduce.common import merge_finished_parts, run_cells_parallel, run_missing_methods

    cfg = validate({**tiny_config, "device": "cpu", "methods": {"ensemble": {}, "fedavg": {}}})
    cache = tmp_path / "cache"
    run_missing_methods({**cfg, "methods": {"ensemble": {}}}, tmp_path / "tiny", cache, None, True)
    part = tmp_path / ".parts" / "tiny" / "fedavg"
    done = run_missing_methods({**cfg, "methods": {"fedavg": {}}}, part, cache, None, True)
    other = {**cfg, "methods": {**cfg["methods"], "fedavg": {"rounds": 2}}}
    assert merge_finished_parts(tmp_path, [validate(other)]) == []  # not the parameters asked for
    assert merge_finished_parts(tmp_path / "nothing") == []
    lines: list[str] = []
    assert run_cells_parallel([cfg], tmp_path, cache, None, jobs=2, threads=1, say=lines.append) == []
    assert lines == ["tiny: fedavg merged (finished in an earlier call)"]  # no worker started
    cell = json.loads((tmp_path / "tiny" / "summary.json").read_text())
    assert set(cell["results"]) == {"ensemble", "fedavg"}
    assert cell["results"]["fedavg"]["accuracy"] == done["results"]["fedavg"]["accuracy"]
    assert (tmp_path / "tiny" / "fedavg" / "metrics.jsonl").is_file() and not part.exists()
    assert merge_finished_parts(tmp_path) == []  # nothing left
    unfinished = tmp_path / ".parts" / "tiny" / "dense"
    unfinished.mkdir(parents=True)
    (unfinished / "summary.json").write_text(json.dumps({"config": cfg, "results": {}}))
    assert merge_finished_parts(tmp_path) == [] and unfinished.exists()


def test_jobs_must_be_positive(capsys):
    from hetfl.cli import main

    assert main(["reproduce", "fedhydra", "--jobs", "0"]) == 2
    assert main(["reproduce", "fedmho", "--jobs", "0"]) == 2
    assert "--jobs must be at least 1" in capsys.readouterr().err


def test_reproduce_fedmho_jobs_trains_each_upload_once_before_its_workers(tmp_path, tiny_config, monkeypatch):
    """FedMHO's methods ask for CVAE uploads that FedAvg never trains: with --jobs the clients' job
    trains them too, so the workers (FedMHO and MD side by side) read every upload from the cache and
    share them, as the in-process run does (on a GPU two trainings of one request give different
    bytes); the grid is archived and reported as without --jobs."""
    from hetfl.cli import main
    from hetfl.engine.simulator import Simulator, prepare
    from hetfl.reproduce import fedmho
    from hetfl.reproduce.common import _plan

    fast = {"cvae_epochs": 1, "cvae_lr": 1e-3, "num_samples": 60, "epochs": 1, "lr": 1e-3}
    cell = {**tiny_config, "device": "cpu", "methods": {"fedavg": {}, "fedmho": fast, "fedmho_md": fast}}
    plan = _plan([validate(json.loads(json.dumps(cell)))], tmp_path / "plan")
    ready, later = plan.ready, plan.later
    assert [(j.methods, j.warm) for j in ready] == [(["fedavg"], ["fedmho", "fedmho_md"])]
    assert [j.methods for j in later["tiny"]] == [["fedmho"], ["fedmho_md"]]
    monkeypatch.setattr(fedmho, "grid", lambda *args, **kw: [json.loads(json.dumps(cell))])
    results = tmp_path / "fedmho.md"
    assert main(["reproduce", "fedmho", "--jobs", "3", "--out", str(tmp_path / "runs"), "--quiet",
                 "--cache-dir", str(tmp_path / "cache"), "--results", str(results)]) == 0
    res = json.loads((tmp_path / "fedmho-runs" / "tiny.json").read_text())["results"]
    assert set(res) == {"fedavg", "fedmho", "fedmho_md"}
    assert res["fedmho"]["cached_uploads"] == res["fedmho_md"]["cached_uploads"] == 3  # none trained there
    assert res["fedmho"]["uploads_sha256"] == res["fedmho_md"]["uploads_sha256"]
    assert results.read_text().startswith("# FedMHO reproduction")
    with pytest.raises(ValueError, match="fills the local upload cache"):
        Simulator(prepare(validate(cell)), tmp_path / "nocache", None, quiet=True).train_uploads({"fedmho": fast})


def test_client_shards_deal_the_clients_round_robin_and_cover_each_once():
    from hetfl.reproduce.common import client_shards

    assert client_shards(10, 5) == [[0, 5], [1, 6], [2, 7], [3, 8], [4, 9]]  # one strong, one weak each
    assert client_shards(3, 8) == [[0], [1], [2]]  # at most one shard per client
    assert client_shards(4, 1) == [[0, 1, 2, 3]]
    for n, k in ((7, 3), (10, 4), (1, 1)):
        ids = sorted(c for shard in client_shards(n, k) for c in shard)
        assert ids == list(range(n))
    with pytest.raises(ValueError, match="client_jobs must be at least 1"):
        client_shards(4, 0)


def test_train_uploads_of_a_shard_trains_only_its_clients(tmp_path, tiny_config):
    from hetfl.engine.simulator import Simulator, prepare

    cfg = validate({**tiny_config, "device": "cpu", "methods": {"fedavg": {}}})
    cache = tmp_path / "cache"
    sim = Simulator(prepare(cfg), tmp_path / "a", cache, quiet=True)
    assert sim.train_uploads({"fedavg": {}}, [2, 0]) == {"fedavg": 2}
    assert len(list(cache.rglob("*.safetensors"))) == 2
    sim = Simulator(prepare(cfg), tmp_path / "b", cache, quiet=True)
    assert sim.train_uploads({"fedavg": {}}, [1]) == {"fedavg": 1} and sim.trained_uploads == 1
    assert sim.train_uploads({"fedavg": {}}) == {"fedavg": 3} and sim.cached_calls == 3  # all cached now
    assert sim.trained_uploads == 1
    with pytest.raises(ValueError, match=r"no client \[3\] in a cell of 3 clients"):
        sim.train_uploads({"fedavg": {}}, [1, 3])


def test_parallel_cells_with_client_jobs_train_each_shard_once_and_give_the_same_results(tmp_path, tiny_config):
    """--client-jobs: a cell's clients are trained by shard processes first (every method's uploads
    for their own clients), then the clients' job and the method workers read them all from the
    cache; the results equal the run without shards (a CPU's training is deterministic)."""
    from hetfl.reproduce.common import run_cells_parallel

    gen = {"epochs": 1, "generator_steps": 2, "batch_size": 16}
    raw = {**tiny_config, "device": "cpu", "methods": {"ensemble": {}, "fedavg": {}, "dense": gen}}
    one: list[str] = []
    assert run_cells_parallel([raw], tmp_path / "one", tmp_path / "c1", None, jobs=2, threads=1,
                              say=one.append) == []
    lines: list[str] = []
    archived: list[str] = []
    assert run_cells_parallel([raw], tmp_path / "par", tmp_path / "c2", None, jobs=3, threads=1,
                              say=lines.append, done=archived.append, client_jobs=2) == []
    started = [line for line in lines if line.endswith("started")]
    assert started == ["tiny: clients 0,2 started", "tiny: clients 1 started", "tiny: ensemble,fedavg started",
                       "tiny: dense started"]
    assert archived == ["tiny"]
    par = json.loads((tmp_path / "par" / "tiny" / "summary.json").read_text())
    seq = json.loads((tmp_path / "one" / "tiny" / "summary.json").read_text())
    for m in raw["methods"]:
        assert par["results"][m]["accuracy"] == seq["results"][m]["accuracy"], m
        assert par["results"][m]["uploads_sha256"] == seq["results"][m]["uploads_sha256"], m
        assert par["results"][m]["cached_uploads"] == 3, m  # none trained after the shards
    parts = tmp_path / "par" / ".parts" / "tiny"
    assert "shard: clients [0, 2], uploads {" in (parts / "clients-0.log").read_text()
    assert not (parts / "clients-0").exists()  # its uploads are in the cache, its log stays
    spec = json.loads((parts / "clients-1.json").read_text())
    assert spec["clients"] == [1] and set(spec["warm"]) == {"ensemble", "fedavg", "dense"}
    with pytest.raises(ValueError, match="client_jobs needs an upload cache"):
        run_cells_parallel([raw], tmp_path / "x", None, None, jobs=2, client_jobs=2)


def test_a_failed_shard_stops_its_cell(tmp_path, tiny_config, monkeypatch):
    from hetfl.reproduce import common

    raw = {**tiny_config, "device": "cpu", "methods": {"ensemble": {}, "fedavg": {}}}
    monkeypatch.setattr(common, "client_shards", lambda n, k: [[0, 1], [7]])  # client 7 does not exist
    lines: list[str] = []
    failed = common.run_cells_parallel([raw], tmp_path, tmp_path / "cache", None, jobs=2, threads=1,
                                       say=lines.append, client_jobs=2)
    assert len(failed) == 1 and failed[0].startswith("tiny: clients 7 (") and failed[0].endswith("clients-1.log)")
    assert "no client [7]" in (tmp_path / ".parts" / "tiny" / "clients-1.log").read_text()
    assert not any("ensemble,fedavg started" in line for line in lines)  # the cell's clients' job never ran
    assert not (tmp_path / "tiny" / "summary.json").exists()


def test_client_jobs_must_be_positive_and_need_jobs(capsys):
    from hetfl.cli import main

    assert main(["reproduce", "fedmho", "--jobs", "2", "--client-jobs", "0"]) == 2
    assert main(["reproduce", "fedhydra", "--client-jobs", "3"]) == 2
    err = capsys.readouterr().err
    assert "--client-jobs must be at least 1" in err and "give --jobs 2 or more" in err


def test_parallel_cells_report_a_failed_worker_with_its_log(tmp_path, tiny_config):
    from hetfl.reproduce.common import run_cells_parallel

    cfg = validate({**tiny_config, "device": "cpu", "methods": {"ensemble": {}, "feddf": {"aux_dataset": "nosuch"}}})
    failed = run_cells_parallel([cfg], tmp_path, tmp_path / "cache", None, jobs=2, say=lambda _: None)
    assert len(failed) == 1 and failed[0].startswith("tiny: feddf (") and failed[0].endswith("feddf.log)")
    for job in ("clients", "feddf"):  # each ran alone, so each had every core
        spec = json.loads((tmp_path / ".parts" / "tiny" / f"{job}.json").read_text())
        assert spec["threads"] == (os.cpu_count() or 1), job
    summary = json.loads((tmp_path / "tiny" / "summary.json").read_text())
    assert set(summary["results"]) == {"ensemble"}  # what finished is kept


def test_worker_threads_share_the_cores_among_the_workers_that_can_run_at_once():
    from hetfl.reproduce.common import worker_threads

    assert worker_threads(2, 2, 1) == 2  # one cell's clients' job alone: both cores
    assert worker_threads(2, 2, 5) == 1  # its methods, two at a time
    assert worker_threads(16, 7, 3) == 5 and worker_threads(16, 7, 30) == 2
    assert worker_threads(2, 4, 4) == 1  # never under one thread
    with pytest.raises(ValueError, match="startable=0"):
        worker_threads(2, 2, 0)


# A stand-in worker that saves on a stop signal as the real ones do: it waits inside stop_deferred,
# writes "saved" once asked to stop, then leaves the block (which re-raises the signal). It touches
# "ready" once its handlers are set; given "kill-self", it sends itself SIGTERM once the file named
# third exists.
FAKE_WORKER = """import os, pathlib, signal, sys, time
from hetfl.fl.training import stop_deferred
out = pathlib.Path(sys.argv[1])
with stop_deferred() as asked:
    (out / "ready").touch()
    if sys.argv[2] == "kill-self":
        while not pathlib.Path(sys.argv[3]).exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
    while asked() is None:
        time.sleep(0.01)
    time.sleep(0.3)
    (out / "saved").write_text(asked().name)
"""


def test_stopping_parallel_workers_sends_sigterm_and_waits_for_their_checkpoints(tmp_path):
    """SIGTERM, which a worker of a background run (SIGINT ignored) also receives."""
    from hetfl.reproduce.common import _Job, _stop

    proc = subprocess.Popen([sys.executable, "-c", FAKE_WORKER, str(tmp_path), "wait"])
    while not (tmp_path / "ready").exists():
        time.sleep(0.01)
    _stop([_Job("cell", ["dense"], tmp_path, tmp_path / "log", proc)], grace=0.1, timeout=60)
    assert proc.returncode == -signal.SIGTERM and (tmp_path / "saved").read_text() == "SIGTERM"


class _Stopped(Exception):
    pass


@pytest.mark.parametrize("how", ["worker", "parent"])
def test_a_stop_signal_stops_every_worker_and_starts_no_other_job(tmp_path, tiny_config, monkeypatch, how):
    """A worker ended by SIGTERM is a stop, not a failure: the parent stops the other worker (which
    saves) and starts no job. So is SIGTERM to the parent: it finishes its loop step, stops both
    workers, then re-raises SIGTERM (here a handler of the test's, not the default that would end it)."""
    from hetfl.reproduce import common

    def fake_start(job, cfg, cache, data_root, quiet, threads):
        job.out.mkdir(parents=True, exist_ok=True)
        if job.methods == ["ensemble", "fedavg"]:  # the clients' job: done at once
            job.proc = subprocess.Popen([sys.executable, "-c", "pass"])
        else:
            other = tmp_path / ".parts" / "tiny" / "feddf" / "ready"
            kill_self = how == "worker" and job.methods == ["dense"]
            job.proc = subprocess.Popen([sys.executable, "-c", FAKE_WORKER, str(job.out),
                                         "kill-self" if kill_self else "wait", str(other)])
        job.start = time.perf_counter()

    def say(line: str) -> None:
        lines.append(line)
        if how == "parent" and line == "tiny: feddf started":
            for m in ("dense", "feddf"):
                while not (tmp_path / ".parts" / "tiny" / m / "ready").exists():
                    time.sleep(0.01)
            signal.raise_signal(signal.SIGTERM)  # held back until the loop's step ends

    def stopped(*_):
        raise _Stopped

    monkeypatch.setattr(common, "_start", fake_start)
    lines: list[str] = []
    raw = {**tiny_config, "device": "cpu",
           "methods": {m: {} for m in ("ensemble", "fedavg", "dense", "feddf", "coboosting")}}
    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        with pytest.raises(_Stopped if how == "parent" else KeyboardInterrupt):
            common.run_cells_parallel([raw], tmp_path, tmp_path / "cache", None, jobs=2, threads=1, say=say)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "tiny: ensemble,fedavg done" in " ".join(lines)
    assert not any("coboosting started" in line for line in lines) and not any("FAILED" in line for line in lines)
    parts = tmp_path / ".parts" / "tiny"
    assert (parts / "feddf" / "saved").read_text() == "SIGTERM"  # stopped by the parent, after its save
    if how == "worker":
        assert any(line.startswith("tiny: dense stopped by a signal") for line in lines)
    else:
        assert (parts / "dense" / "saved").read_text() == "SIGTERM"


# ---- the archive: measured summaries kept in git beside the results file --------------------------
def fake_metrics(cell):
    """A metrics.jsonl logging three epochs of DENSE and FedHydra (FedHydra's last epoch twice, as a
    resumed stage does) and FedAvg's final row."""
    rows = [{"method": "fedavg", "step": -1, "final": True, "accuracy": 39.0}]
    rows += [{"method": m, "step": e, "accuracy": base + e} for m, base in (("dense", 20.0), ("fedhydra", 30.0))
             for e in (1, 2, 3)]
    rows += [{"method": "fedhydra", "step": 3, "accuracy": 33.0}]
    (cell / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))


def fake_cell_with_curves(root, dataset, setting, seed, fedhydra=60.0):
    cfg = fake_summary(root, dataset, setting, seed, {**dict.fromkeys(("ensemble", *paper.METHODS), 40.0),
                                                      "fedhydra": fedhydra})
    fake_metrics(root / cfg["name"])
    return cfg


@pytest.mark.parametrize("which", ["fedhydra", "fedmho"])
def test_cli_archives_every_finished_cell_beside_the_results_file(tmp_path, monkeypatch, capsys, which):
    from hetfl.cli import main
    from hetfl.reproduce import common
    from hetfl.reproduce import fedmho as mho

    def fake_run_cell(cfg, root, cache, data_root, runner):
        (root / cfg["name"]).mkdir(parents=True)
        summary = {"config": cfg, "results": {m: {"accuracy": 39.0, "best_accuracy": 40.0} for m in cfg["methods"]},
                   "minutes": 2.0}
        (root / cfg["name"] / "summary.json").write_text(json.dumps(summary, indent=1))
        fake_metrics(root / cfg["name"])
        return summary

    for module in (paper, mho, common):
        monkeypatch.setattr(module, "run_cell", fake_run_cell)
    archive = tmp_path / "out-runs"
    archive.mkdir()  # an earlier copy with a hand-written note
    name = (paper if which == "fedhydra" else mho).cell_config("mnist", "0.1", 0, "reduced")["name"]
    (archive / f"{name}.json").write_text(json.dumps({"config": {}, "note": "written by hand"}))
    assert main(["reproduce", which, "--datasets", "mnist", "--settings", "0.1", "--seeds", "0",
                 "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "out.md"), "--quiet"]) == 0
    summary = json.loads((tmp_path / "runs" / name / "summary.json").read_text())
    saved = (archive / f"{name}.json").read_text()
    if which == "fedhydra":  # the curves the report plots, one point per step, in step order
        curves = {"dense": [[1, 21.0], [2, 22.0], [3, 23.0]], "fedhydra": [[1, 31.0], [2, 32.0], [3, 33.0]]}
        assert saved == json.dumps({**summary, "note": "written by hand", "curves": curves}, indent=1)
    else:  # FedMHO's Fig. 6 curve is part of the summary: nothing to add
        assert saved == json.dumps({**summary, "note": "written by hand"}, indent=1)
    assert not list(archive.glob("*.tmp"))
    # two of the cell's methods again into another folder: the full archived cell stays, and the run says where
    # the subset went
    capsys.readouterr()
    assert main(["reproduce", which, "--datasets", "mnist", "--settings", "0.1", "--seeds", "0", "--methods",
                 "fedavg,feddf", "--out", str(tmp_path / "subset"), "--results", str(tmp_path / "out.md"),
                 "--quiet"]) == 0
    assert (archive / f"{name}.json").read_text() == saved
    partial = archive / "partial" / "subset" / f"{name}.json"
    assert set(json.loads(partial.read_text())["results"]) - {"ensemble"} == {"fedavg", "feddf"}
    assert f"{name}: fewer methods than its archived copy, archived as {partial}" in capsys.readouterr().out


def test_a_report_from_the_archive_alone_equals_the_report_from_the_runs(tmp_path):
    import shutil

    from hetfl.reproduce.common import archive_cell, archive_folder

    runs, out = tmp_path / "runs", tmp_path / "docs" / "out.md"
    for setting, seed in (("0.1", 0), ("0.1", 1), ("2c/c", 0)):
        name = fake_cell_with_curves(runs, "mnist", setting, seed, 60.0 + seed)["name"]
        archive_cell(runs, name, archive_folder(out), paper.CURVE_METHODS)
    paper.write_results(runs, out)
    from_runs = out.read_text()
    figure = paper.figure_path(out, "mnist", "reduced")
    assert f"]({figure.name})" in from_runs
    shutil.rmtree(runs)
    figure.unlink()
    paper.write_results(runs, out)
    assert out.read_text() == from_runs
    assert figure.is_file()  # drawn again from the archived curves


def test_the_runs_folder_wins_over_the_archive_for_the_same_cell(tmp_path):
    import shutil

    from hetfl.reproduce.common import archive_cell, archive_folder, cell_summaries

    runs, archive = tmp_path / "runs", archive_folder(tmp_path / "out.md")
    old = fake_cell_with_curves(runs, "mnist", "0.1", 0, fedhydra=50.0)["name"]
    archive_cell(runs, old, archive, paper.CURVE_METHODS)
    only_archived = fake_cell_with_curves(runs, "mnist", "0.1", 1, fedhydra=52.0)["name"]
    archive_cell(runs, only_archived, archive, paper.CURVE_METHODS)
    shutil.rmtree(runs / only_archived)
    shutil.rmtree(runs / old)
    fake_summary(runs, "mnist", "0.1", 0, {**dict.fromkeys(("ensemble", *paper.METHODS), 40.0), "fedhydra": 70.0})
    (runs / old / "metrics.jsonl").write_text(json.dumps({"method": "dense", "step": 1, "accuracy": 5.0}) + "\n"
                                              + json.dumps({"method": "dense", "step": 2, "accuracy": 6.0}))
    cells = {s["config"]["name"]: s for s in cell_summaries(runs, "fedhydra", archive)}
    assert list(cells) == [old, only_archived]
    assert cells[old]["results"]["fedhydra"]["best_accuracy"] == 70.0
    assert paper.epoch_curves(runs, cells[old]) == {"dense": [5.0, 6.0]}  # its metrics.jsonl, not the archive's
    assert paper.epoch_curves(runs, cells[only_archived]) == {"dense": [21.0, 22.0, 23.0],
                                                              "fedhydra": [31.0, 32.0, 33.0]}
    (runs / old / "metrics.jsonl").unlink()  # no metrics in the runs folder: the archived curves of the
    cells = {s["config"]["name"]: s for s in cell_summaries(runs, "fedhydra", archive)}  # unchanged methods
    assert paper.epoch_curves(runs, cells[old]) == {"dense": [21.0, 22.0, 23.0]}  # fedhydra was run again
    text = paper.report(runs, "reduced", archive)
    assert "61.00 ± 12.73 (60.00 ± 12.73) n=2" in text  # 70 from the runs folder, 52 from the archive


def test_an_archived_cell_never_loses_methods_to_a_subset_run_into_another_folder(tmp_path):
    from hetfl.reproduce.common import archive_cell, archive_folder, cell_summaries

    archive = archive_folder(tmp_path / "out.md")
    methods = {"ensemble", *paper.METHODS}
    name = fake_summary(tmp_path / "runs", "mnist", "0.1", 0, dict.fromkeys(methods, 40.0))["name"]
    kept = archive_cell(tmp_path / "runs", name, archive)
    before = kept.read_text()
    subset = tmp_path / "ablation-runs"  # two of the cell's methods again, beside an ablation
    fake_summary(subset, "mnist", "0.1", 0, {"dense": 41.0, "fedhydra": 71.0})
    partial = archive_cell(subset, name, archive)
    assert kept.read_text() == before
    assert partial == archive / "partial" / "ablation-runs" / f"{name}.json"
    assert set(json.loads(partial.read_text())["results"]) == {"dense", "fedhydra"}
    assert not list(archive.glob("partial/**/*.tmp"))
    cells = cell_summaries(subset, "fedhydra", archive)  # the report reads the fuller archived cell
    assert [set(s["results"]) for s in cells] == [methods]
    assert cells[0]["results"]["fedhydra"]["best_accuracy"] == 40.0
    fake_summary(subset, "mnist", "0.1", 0, {**dict.fromkeys(methods, 42.0), "fedhydra_dense": 60.0})
    assert archive_cell(subset, name, archive) == kept  # every archived method and one more: replaces it
    assert json.loads(kept.read_text())["results"]["fedhydra_dense"]["best_accuracy"] == 60.0
    assert cell_summaries(subset, "fedhydra", archive)[0]["results"]["dense"]["best_accuracy"] == 42.0


def test_a_budget_without_curves_keeps_an_existing_figure_and_its_link(tmp_path):
    out = tmp_path / "out.md"
    fake_summary(tmp_path / "runs", "mnist", "0.1", 0, dict.fromkeys(("ensemble", *paper.METHODS), 40.0))
    kept = paper.figure_path(out, "mnist", "reduced")
    kept.write_bytes(b"drawn from runs that are gone")
    stray = paper.figure_path(out, "fmnist", "paper")  # a budget without cells has no section to link it in
    stray.write_bytes(b"old")
    assert paper.plot_curves(tmp_path / "runs", out, "reduced") == []
    paper.write_results(tmp_path / "runs", out)
    text = out.read_text()
    assert kept.read_bytes() == b"drawn from runs that are gone"
    assert f"![{kept.stem}]({kept.name})" in text and stray.name not in text
    # A method added to that cell later logs its own curve only: the figure is not redrawn from it alone,
    # and the archive joins the new curve with those it had.
    from hetfl.reproduce.common import archive_cell, archive_folder

    cell = paper.cell_config("mnist", "0.1", 0, "reduced")["name"]
    archived = archive_folder(out) / f"{cell}.json"
    archived.parent.mkdir(parents=True, exist_ok=True)
    archived.write_text(json.dumps({**json.loads((tmp_path / "runs" / cell / "summary.json").read_text()),
                                    "curves": {"dense": [[1, 30.0], [2, 35.0]]}}))
    rows = [{"method": "fedhydra_dense", "step": e, "accuracy": a} for e, a in ((1, 50.0), (2, 55.0))]
    (tmp_path / "runs" / cell / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert paper.plot_curves(tmp_path / "runs", out, "reduced") == []
    assert kept.read_bytes() == b"drawn from runs that are gone"
    archive_cell(tmp_path / "runs", cell, archive_folder(out), paper.CURVE_METHODS)
    assert set(json.loads(archived.read_text())["curves"]) == {"dense", "fedhydra_dense"}


def test_fedmho_report_and_fig6_from_the_archive_alone(tmp_path):
    import shutil

    from hetfl.reproduce import fedmho as mho
    from hetfl.reproduce.common import archive_cell, archive_folder

    runs, out = tmp_path / "runs", tmp_path / "fedmho.md"
    cfg = mho.cell_config("mnist", "0.5", 0, "reduced", variant="curve")
    (runs / cfg["name"]).mkdir(parents=True)
    curves = {"fedmho": [95.0, 94.0, 96.0], "fedmho_md": [95.0, 93.0, 93.5], "fedmho_sd": [95.0, 92.5, 93.9]}
    results = {m: {"accuracy": c[-1], "best_accuracy": max(c), "curve": c} for m, c in curves.items()}
    (runs / cfg["name"] / "summary.json").write_text(json.dumps({"config": cfg, "results": results}))
    archive_cell(runs, cfg["name"], archive_folder(out))
    mho.write_results(runs, out)
    from_runs = out.read_text()
    png = out.with_name(f"fedmho-fig6-{cfg['name']}.png")
    shutil.rmtree(runs)
    png.unlink()
    mho.write_results(runs, out)
    assert out.read_text() == from_runs and f"]({png.name})" in from_runs
    assert png.is_file()  # the curve is in the archived summary


def test_one_cache_section_ranks_fedhydra_dense_against_the_baselines_on_means_and_per_seed(tmp_path):
    folder = tmp_path / "fedhydra-runs" / paper.ONE_CACHE
    folder.mkdir(parents=True)
    assert paper.one_cache_report(folder) == ""  # nothing archived: no section
    base = dict.fromkeys(("ensemble", "fedavg", "ot", "feddf", "dense", "coboosting"), 40.0)
    for seed, (ours, cob) in enumerate([(60.0, 45.0), (50.0, 55.0), (70.0, 41.0)]):
        cfg = paper.cell_config("mnist", "0.1", seed, "reduced")
        results = {m: shuffled(m, {"accuracy": a - 1, "best_accuracy": a})
                   for m, a in {**base, "coboosting": cob, "fedhydra_dense": ours}.items()}
        (folder / f"{cfg['name']}.json").write_text(json.dumps({"config": cfg, "results": results, "minutes": 3.0}))
    text = paper.one_cache_report(folder)
    lines = text.splitlines()
    assert lines[0] == "## All methods on one upload cache (budget `reduced`)"
    rows = [x.split(" |")[0] for x in lines if x.startswith("| ") and not x.startswith("| method")]
    assert rows == ["| ensemble (teacher)", "| FedAvg", "| OT", "| FedDF", "| DENSE", "| Co-Boosting",
                    "| FedHydra", "| FedHydra in DENSE's loop, as the authors' code (ours)"]
    hydra = next(x for x in lines if x.startswith("| FedHydra |"))
    assert "not run | 59.97" in hydra  # the paper's FedHydra, beside our fedhydra_dense row
    dense_loop = next(x for x in lines if x.startswith("| FedHydra in DENSE's loop"))
    assert "60.00 ± 10.00 (59.00 ± 10.00) n=3 | -" in dense_loop
    verdict = next(x for x in lines if x.startswith("- 0.1 (n=3)"))
    assert verdict.startswith("- 0.1 (n=3): `fedhydra_dense` first (60.00 vs best baseline 47.00)")
    assert "not compared" not in verdict  # FedHydra is the candidate's paper row, not a baseline
    assert verdict.endswith("per seed, above every baseline run in 2 of 3")
    assert "Minutes per cell (all methods, incl. local training): 3.00 ± 0.00 over 3 cells." in text
    paper.write_results(tmp_path / "runs", tmp_path / "fedhydra.md")
    assert "## All methods on one upload cache" in (tmp_path / "fedhydra.md").read_text()
    # fedhydra_dense_log1p added to two of the cells: its own row and its own verdict
    for seed, acc in ((0, 80.0), (1, 52.0)):
        path = folder / f"{paper.cell_config('mnist', '0.1', seed, 'reduced')['name']}.json"
        cell = json.loads(path.read_text())
        cell["results"]["fedhydra_dense_log1p"] = shuffled("fedhydra_dense_log1p",
                                                           {"accuracy": acc - 1, "best_accuracy": acc})
        path.write_text(json.dumps(cell))
    lines = paper.one_cache_report(folder).splitlines()
    log1p = next(x for x in lines if x.startswith("| FedHydra in DENSE's loop, log1p(U) (ours) |"))
    assert "| 66.00 ± 19.80 (65.00 ± 19.80) n=2 | - |" in log1p
    assert [x for x in lines if x.startswith("- 0.1")] == [verdict]  # log1p not in every seed: no verdict yet
    path = folder / f"{paper.cell_config('mnist', '0.1', 2, 'reduced')['name']}.json"
    cell = json.loads(path.read_text())
    cell["results"]["fedhydra_dense_log1p"] = shuffled("fedhydra_dense_log1p",
                                                       {"accuracy": 70.0, "best_accuracy": 71.0})
    path.write_text(json.dumps(cell))
    verdicts = [x for x in paper.one_cache_report(folder).splitlines() if x.startswith("- 0.1")]
    assert len(verdicts) == 2 and verdicts[0].startswith("- 0.1 (n=3): `fedhydra_dense` first")
    assert verdicts[0].split(";")[0].endswith(", FedHydra in DENSE's loop, log1p(U) (ours) 67.67")
    assert verdicts[1].startswith("- 0.1 (n=3): `fedhydra_dense_log1p` first (67.67 vs best baseline 47.00)")
    assert verdicts[1].endswith("per seed, above every baseline run in 2 of 3")


def test_reduced_t60_differs_from_reduced_only_in_the_server_epochs_and_gets_its_own_one_cache_section(tmp_path):
    short, long = (paper.cell_config("fmnist", "0.5", 1, b) for b in ("reduced", "reduced-t60"))
    assert long["name"] == "fedhydra-fmnist-0.5-s1-reduced-t60"
    assert {k: v for k, v in long.items() if k not in ("name", "methods")} == \
        {k: v for k, v in short.items() if k not in ("name", "methods")}  # same clients: the cached uploads
    for m, params in long["methods"].items():
        assert params == ({**short["methods"][m], "epochs": 60} if "epochs" in params else short["methods"][m])
    folder = tmp_path / "fedhydra-runs" / paper.ONE_CACHE
    folder.mkdir(parents=True)
    for budget, acc in (("reduced", 60.0), ("reduced-t60", 70.0)):
        cfg = paper.cell_config("fmnist", "0.5", 0, budget)
        results = {m: shuffled(m, {"accuracy": acc - 1, "best_accuracy": acc}) for m in ("ensemble", "fedavg", "dense")}
        curves = {"dense": [[e, acc - 60 + e / 2] for e in range(1, cfg["methods"]["dense"]["epochs"] + 1)]}
        (folder / f"{cfg['name']}.json").write_text(json.dumps({"config": cfg, "results": results, "curves": curves}))
    out = tmp_path / "fedhydra.md"
    paper.write_results(tmp_path / "runs", out)
    text = out.read_text()
    assert "## All methods on one upload cache (budget `reduced`)" in text
    t60 = text.split("## All methods on one upload cache (budget `reduced-t60`)")[1]
    assert "| DENSE | 70.00 (69.00) n=1 |" in t60 and "60.00" not in t60  # only that budget's cells
    for budget in ("reduced", "reduced-t60"):
        png = paper.one_cache_figure_path(out, "fmnist", budget)
        assert png.stat().st_size > 0 and f"]({png.name})" in text


def test_reduced_t60_g30_differs_from_reduced_t60_only_in_the_generator_steps():
    t60, g30 = (paper.cell_config("mnist", "0.3", 2, b) for b in ("reduced-t60", "reduced-t60-g30"))
    assert g30["name"] == "fedhydra-mnist-0.3-s2-reduced-t60-g30"
    assert {k: v for k, v in g30.items() if k not in ("name", "methods")} == \
        {k: v for k, v in t60.items() if k not in ("name", "methods")}  # same clients: the cached uploads
    for m, params in g30["methods"].items():
        steps = {"generator_steps": 30} if "generator_steps" in params else {}
        assert params == {**t60["methods"][m], **steps}


def test_bf16_budget_differs_from_its_fp32_twin_only_in_the_generator_familys_precision():
    assert paper.fp32_twin("reduced-t60-g30-bf16") == "reduced-t60-g30"
    assert "reduced-t60-g30-bf16" not in paper.FP32_BUDGETS and "reduced-t60-g30" in paper.FP32_BUDGETS
    g30, bf16 = (paper.cell_config("fmnist", "2c/c", 1, b) for b in ("reduced-t60-g30", "reduced-t60-g30-bf16"))
    assert bf16["name"] == "fedhydra-fmnist-2cc-s1-reduced-t60-g30-bf16"
    assert {k: v for k, v in bf16.items() if k not in ("name", "methods")} == \
        {k: v for k, v in g30.items() if k not in ("name", "methods")}  # same clients: the cached uploads
    for m, params in bf16["methods"].items():
        extra = {"precision": "bf16"} if m in paper.GENERATOR_FAMILY else {}
        assert params == {**g30["methods"][m], **extra}
        assert "precision" not in g30["methods"][m]  # fp32 configs stay as archived
        if extra:
            validate({**bf16, "methods": {m: params}})  # the loop accepts the key


def test_paper_bf16_budget_is_paper_with_bf16_clients_and_generator_family_and_has_its_own_table(tmp_path):
    fp32, bf16 = (paper.cell_config("mnist", "0.01", 0, b) for b in ("paper", "paper-bf16"))
    assert bf16["name"] == "fedhydra-mnist-0.01-s0-paper-bf16"
    assert bf16["client"] == {**fp32["client"], "precision": "bf16"}  # other uploads than paper's
    assert "precision" not in fp32["client"]
    for m, params in bf16["methods"].items():
        extra = {"precision": "bf16"} if m in paper.GENERATOR_FAMILY else {}
        assert params == {**fp32["methods"][m], **extra}  # FedDF, OT, FedAvg as at paper
    validate(bf16)
    assert (*paper.FP32_BUDGETS, "paper-bf16") == paper.TABLE_BUDGETS
    # its cells go to a table of their own, with the paper's numbers beside them
    summary = {"config": bf16, "environment": {}, "results": {
        "ensemble": {"accuracy": 29.0, "best_accuracy": 29.0},
        "dense": shuffled("dense", {"accuracy": 20.0, "best_accuracy": 25.0}),
        paper.VARIANT: shuffled(paper.VARIANT, {"accuracy": 65.0, "best_accuracy": 75.0})}}
    cell = tmp_path / "runs" / bf16["name"]
    cell.mkdir(parents=True)
    (cell / "summary.json").write_text(json.dumps(summary))
    text = paper.report(tmp_path / "runs", "paper-bf16")
    assert text.startswith("## Budget `paper-bf16`")
    dense = next(line for line in text.splitlines() if line.startswith("| DENSE |"))
    assert "| 25.00 (20.00) n=1 | 11.17 |" in dense  # MNIST α = 0.01: ours beside the paper's
    assert "### MNIST" not in paper.report(tmp_path / "runs", "paper")  # not mixed into paper's fp32 table


def test_precision_section_pairs_each_bf16_cell_with_its_fp32_twin_on_the_same_uploads(tmp_path):
    folder = tmp_path / "fedhydra-runs" / paper.ONE_CACHE
    folder.mkdir(parents=True)

    def write(budget: str, best: dict[str, float], generation: float, digest: str, cpu: str = "CPU A") -> None:
        cfg = paper.cell_config("mnist", "0.01", 1, budget)
        results = {m: {"accuracy": a - 2, "best_accuracy": a, "uploads_sha256": digest,
                       **({"timing_seconds": {"generation": generation}} if m in paper.GENERATOR_FAMILY else {})}
                   for m, a in best.items()}
        summary = {"config": cfg, "results": results, "environment": {"cpu": cpu}}
        (folder / f"{cfg['name']}.json").write_text(json.dumps(summary))

    write("reduced-t60-g30", {"fedavg": 30.0, "dense": 20.0, "fedhydra_dense_log1p": 70.0}, 400.0, "a" * 64)
    write("reduced-t60-g30-bf16", {"fedavg": 30.0, "fedhydra_dense_log1p": 68.5}, 200.0, "a" * 64)
    text = paper.precision_report(folder)
    rows = [x for x in text.splitlines() if x.startswith("| `reduced-t60-g30-bf16`")]
    assert rows == ["| `reduced-t60-g30-bf16` | mnist-0.01-s1 | " + paper.LABELS["fedhydra_dense_log1p"]
                    + " | 70.00 (68.00) | 68.50 (66.50) | -1.50 | -1.50 | 400 → 200 (2.00x) |"]  # DENSE: fp32 only
    summary = next(x for x in text.splitlines() if x.startswith(f"| {paper.LABELS['fedhydra_dense_log1p']} | 1 |"))
    assert "| -1.50 | -1.50 | 1.50 | 2.00x (1) |" in summary
    paper.write_results(tmp_path / "runs", tmp_path / "fedhydra.md")  # the results file carries the section
    assert "## Precision: bf16 autocast against fp32" in (tmp_path / "fedhydra.md").read_text()
    # the bf16 cell stays out of the standing table and the fp32 one-cache sections
    assert set(next(iter(paper.standing(folder).values()))["budgets"]) == {"reduced-t60-g30"}
    assert "68.50" not in paper.one_cache_report(folder, "reduced-t60-g30")
    # timings from two processors are not compared
    write("reduced-t60-g30-bf16", {"fedavg": 30.0, "fedhydra_dense_log1p": 68.5}, 200.0, "a" * 64, cpu="CPU B")
    assert "| other processors |" in paper.precision_report(folder)
    # nor timings under other host settings: a result merged from another run carries its own environment
    write("reduced-t60-g30-bf16", {"fedavg": 30.0, "fedhydra_dense_log1p": 68.5}, 200.0, "a" * 64)
    name = folder / f"{paper.cell_config('mnist', '0.01', 1, 'reduced-t60-g30-bf16')['name']}.json"
    merged = json.loads(name.read_text())
    merged["results"]["fedhydra_dense_log1p"]["environment"] = {"cpu": "CPU A", "malloc": "glibc 2.36: kept"}
    name.write_text(json.dumps(merged))
    assert "| other host settings |" in paper.precision_report(folder)
    merged["results"]["fedhydra_dense_log1p"]["environment"] = {"cpu": "CPU A", "threads": 1}  # another thread count
    name.write_text(json.dumps(merged))
    assert "| other host settings |" in paper.precision_report(folder)
    # ours re-run in fp32 after its reshuffle became the default, the bf16 twin not: the bf16 run is set
    # beside the fp32 result the re-run replaced (the same defaults), or left out where there is none
    write("reduced-t60-g30-bf16", {"fedavg": 30.0, "fedhydra_dense_log1p": 68.5}, 200.0, "a" * 64)
    fp32_file = folder / f"{paper.cell_config('mnist', '0.01', 1, 'reduced-t60-g30')['name']}.json"
    rerun = json.loads(fp32_file.read_text())
    older = rerun["results"]["fedhydra_dense_log1p"]
    rerun["results"]["fedhydra_dense_log1p"] = shuffled("fedhydra_dense_log1p", {**older, "best_accuracy": 75.0})
    fp32_file.write_text(json.dumps(rerun))
    assert paper.precision_report(folder) == ""  # no earlier result kept: no like-for-like pair
    rerun["replaced"] = {"fedhydra_dense_log1p": [{"result": older, "config": {}}]}
    fp32_file.write_text(json.dumps(rerun))
    assert "| 70.00 (68.00) | 68.50 (66.50) | -1.50 | -1.50 | 400 → 200 (2.00x) |" in paper.precision_report(folder)
    write("reduced-t60-g30", {"fedavg": 30.0, "dense": 20.0, "fedhydra_dense_log1p": 70.0}, 400.0, "a" * 64)
    # other uploads: no pair, no section
    write("reduced-t60-g30-bf16", {"fedavg": 30.0, "fedhydra_dense_log1p": 68.5}, 200.0, "b" * 64)
    assert paper.precision_report(folder) == ""


def test_ordering_without_any_baseline_says_so_instead_of_ranking_first(tmp_path):
    fake_summary(tmp_path, "fmnist", "0.01", 0, {"ensemble": 20.0, "fedhydra": 40.0}, budget="reduced-t60")
    text = paper.report(tmp_path, "reduced-t60")
    assert "- 0.01 (n=1): no baseline ran in every cell, nothing to compare" in text
    assert "FedHydra first" not in text


def test_standing_table_gives_each_cell_the_variant_the_best_baseline_per_budget_and_the_gap_to_the_paper(tmp_path):
    folder = tmp_path / "fedhydra-runs" / paper.ONE_CACHE
    folder.mkdir(parents=True)
    assert paper.standing_report(folder) == ""  # nothing archived: no section
    cells = [("reduced", "0.1", 0, {"fedavg": 40.0, "coboosting": 50.0, "fedhydra_dense_log1p": 60.0}),
             ("reduced", "0.1", 1, {"fedavg": 44.0, "coboosting": 42.0, "fedhydra_dense_log1p": 64.0}),
             ("reduced-t60", "0.1", 0, {"fedavg": 40.0, "fedhydra_dense_log1p": 70.0}),
             ("reduced-t60", "0.5", 0, {"fedhydra_dense_log1p": 80.0}),  # no baseline: not bold
             ("reduced", "0.3", 0, {"coboosting": 70.0, "fedhydra_dense": 90.0})]  # no variant: "-"
    for budget, setting, seed, accs in cells:
        cfg = paper.cell_config("mnist", setting, seed, budget)
        results = {m: shuffled(m, {"accuracy": a - 1, "best_accuracy": a}) for m, a in accs.items()}
        (folder / f"{cfg['name']}.json").write_text(json.dumps({"config": cfg, "results": results}))
    specified = [{"config": paper.cell_config("mnist", "0.1", seed, "reduced"),
                  "results": {"fedhydra": {"accuracy": 10.0, "best_accuracy": acc}}}
                 for seed, acc in ((0, 30.0), (1, 20.0))]  # FedHydra as specified, on the reduced grid
    lines = paper.standing_report(folder, specified).splitlines()
    assert lines[0] == "## Where the reproduction stands (best over epochs, one upload cache)"
    rows = {tuple(x.split(" | ")[:2]): x for x in lines if x.startswith("| MNIST") or x.startswith("| FMNIST")}
    assert len(rows) == 10
    # best baseline = highest mean over seeds (Co-Boosting 46 over FedAvg 42, though FedAvg wins seed 1);
    # the gap to the paper is taken at the budget where ours is highest
    # (these Co-Boosting results have no ``params``: they ran its older defaults, marked †, with a footnote)
    assert rows[("| MNIST", "α=0.1")] == ("| MNIST | α=0.1 | 59.97 | 25.00 n=2 | **62.00 n=2** | 46.00 Co-Boosting † | "
                                         "**70.00 n=1** | 40.00 FedAvg | +10.03 (`reduced-t60`) |")
    assert lines[-1].startswith("† Co-Boosting without its code's gradient clipping")
    assert rows[("| MNIST", "α=0.5")] == \
        "| MNIST | α=0.5 | 88.75 | - | - | - | 80.00 n=1 | none run | -8.75 (`reduced-t60`) |"
    assert rows[("| MNIST", "α=0.3")] == "| MNIST | α=0.3 | 85.16 | - | - | - | - | - | - |"
    assert rows[("| FMNIST", "2c/c")].endswith("| 39.06 | - | - | - | - | - | - |")
    rows = paper.standing(folder, specified)
    assert rows["mnist", "0.1"]["budgets"]["reduced"]["ours"] == [60.0, 64.0]  # per seed, for the error bars
    assert rows["mnist", "0.1"]["budgets"]["reduced"]["best"] == ("coboosting", 46.0)
    assert rows["mnist", "0.1"]["specified"] == [30.0, 20.0]
    assert rows["mnist", "0.3"]["budgets"]["reduced"] == {"ours": [], "best": None, "best_mark": "",
                                                          "ours_mark": ""}  # no variant run
    assert "paper_budget" not in rows["mnist", "0.1"]  # no paper-budget cells: no such columns
    gpu = {"config": paper.cell_config("mnist", "0.1", 0, "paper"),
           "results": {m: shuffled(m, {"accuracy": a - 1, "best_accuracy": a})
                       for m, a in {"dense": 61.0, "fedavg": 38.0, "fedhydra_dense_log1p": 74.0}.items()}}
    lines = paper.standing_table(paper.standing(folder, specified, [gpu])).splitlines()
    assert next(x for x in lines if x.startswith("| dataset |")).endswith(
        "| `paper` ours | `paper` best baseline | ours - paper |")
    row = next(x for x in lines if x.startswith("| MNIST | α=0.1 |"))
    assert row.endswith("| **74.00 n=1** | 61.00 DENSE | +10.03 (`reduced-t60`) |")  # not in the gap
    assert next(x for x in lines if x.startswith("| MNIST | α=0.5 |")).endswith("| - | - | -8.75 (`reduced-t60`) |")
    paper.write_results(tmp_path / "runs", tmp_path / "fedhydra.md")
    text = (tmp_path / "fedhydra.md").read_text()
    assert text.index("## Where the reproduction stands") < text.index("## All methods on one upload cache")
    png = paper.standing_figure_path(tmp_path / "fedhydra.md")
    assert png.stat().st_size > 0 and text.index(f"]({png.name})") < text.index("## All methods on one")
    assert paper.plot_standing({}, tmp_path / "other.md") is None


def test_fedmho_standing_table_means_the_seeds_ranks_md_sd_against_the_best_baseline_and_gives_the_gap(tmp_path):
    from hetfl.reproduce import fedmho as mho

    runs = tmp_path / "runs"
    assert mho.standing_report(runs) == ""  # no cell: no section
    cells = [("0.1", 0, {"fedavg": 50.0, "fedcvae_ens": 80.0, "fedmho": 85.0, "fedmho_md": 70.0, "fedmho_sd": 90.0}),
             ("0.1", 1, {"fedavg": 60.0, "fedcvae_ens": 84.0, "fedmho": 83.0, "fedmho_md": 72.0, "fedmho_sd": 84.0,
                         "fedmho_md_klmean": 75.0}),
             ("0.5", 0, {"fedmho": 90.0})]  # FedMHO alone: no MD, no baseline
    for setting, seed, accs in cells:
        cfg = mho.cell_config("fmnist", setting, seed, "reduced")
        (runs / cfg["name"]).mkdir(parents=True)
        results = {m: {"accuracy": a, "best_accuracy": a + 1} for m, a in accs.items()}
        (runs / cfg["name"] / "summary.json").write_text(json.dumps({"config": cfg, "results": results}))
    lines = mho.standing_report(runs).splitlines()
    assert lines[0] == "## Where the reproduction stands (Table 4, final epoch)"
    rows = {tuple(x.split(" | ")[:2]): x for x in lines if x.startswith("| MNIST") or x.startswith("| FMNIST")}
    assert len(rows) == 6  # every (dataset, setting) of Table 4, run or not
    # FedCVAE-Ens 82 is the best baseline; SD 87 is above it (bold), MD 71 is not; gaps to the paper's 71.04 / 69.65
    assert rows[("| FMNIST", "Dir(0.1)")] == ("| FMNIST | Dir(0.1) | 62.14 / 84.00 | 71.04 / 69.65 | 71.00 / **87.00** "
                                             "n=2 | 75.00 (n=1) / - | 82.00 FedCVAE(-Ens) | -0.04 / +17.35 |")
    assert rows[("| FMNIST", "Dir(0.5)")] == \
        "| FMNIST | Dir(0.5) | 75.30 / 90.00 | 77.27 / 77.73 | not run | - / - | - | - / - |"
    # a KL-mean variant on the same seeds as MD/SD needs no count, on as many but other seeds it does
    for seed, accs in ((0, {"fedmho_md": 70.0, "fedmho_md_klmean": 74.0}), (1, {"fedmho_sd_klmean": 76.0})):
        cfg = mho.cell_config("mnist", "0.3", seed, "reduced")
        (runs / cfg["name"]).mkdir(parents=True)
        results = {m: {"accuracy": a, "best_accuracy": a} for m, a in accs.items()}
        (runs / cfg["name"] / "summary.json").write_text(json.dumps({"config": cfg, "results": results}))
    row = next(x for x in mho.standing_report(runs).splitlines() if x.startswith("| MNIST | Dir(0.3)"))
    assert "| 74.00 / 76.00 (n=1) |" in row
    mho.write_results(runs, tmp_path / "fedmho.md")
    text = (tmp_path / "fedmho.md").read_text()
    assert text.index("## Where the reproduction stands") < text.index("## Budget `reduced`")


def test_fedmho_filter_sweep_pairs_ablation_cells_with_table4_on_the_same_uploads(tmp_path):
    from hetfl.reproduce import fedmho as mho

    runs = tmp_path / "runs"

    def cell(variant: str, seed: int, accs: dict[str, float], digest: str) -> None:
        cfg = mho.cell_config("mnist", "0.1", seed, "reduced", variant=variant)
        results = {m: {"accuracy": a, "best_accuracy": a, "uploads_sha256": digest} for m, a in accs.items()}
        (runs / cfg["name"]).mkdir(parents=True)
        (runs / cfg["name"] / "summary.json").write_text(json.dumps({"config": cfg, "results": results}))

    cell("main", 0, {"fedavg": 40.0, "fedmho": 80.0, "fedmho_md": 70.0, "fedmho_sd": 72.0}, "up0")
    cell("main", 1, {"fedavg": 41.0, "fedmho": 84.0, "fedmho_md": 74.0, "fedmho_sd": 76.0}, "up1")
    cell("rth0.4", 0, {"fedmho": 77.0, "fedmho_md": 69.0, "fedmho_sd": 71.0}, "up0")
    cell("rth0.4", 1, {"fedmho": 83.0, "fedmho_md": 73.0, "fedmho_sd": 75.0}, "up1")
    cell("nofilter", 0, {"fedmho_md": 72.0, "fedmho_sd": 75.0}, "up0")
    cell("rth0.9", 1, {"fedmho": 99.0, "fedmho_md": 99.0, "fedmho_sd": 99.0}, "other")  # other uploads: left out
    pairs = mho.filter_pairs(mho._cells(runs, "reduced"))
    assert set(pairs) == {("mnist", "0.1", m) for m in mho.CURVE_METHODS}
    assert pairs[("mnist", "0.1", "fedmho")] == {"rth0.4": [(77.0, -3.0), (83.0, -1.0)],
                                               "main": [(80.0, 0.0), (84.0, 0.0)]}
    assert pairs[("mnist", "0.1", "fedmho_sd")]["nofilter"] == [(75.0, 3.0)]
    assert sorted(pairs[("mnist", "0.1", "fedmho_sd")]["main"]) == [(72.0, 0.0), (76.0, 0.0)]
    assert "rth0.9" not in pairs[("mnist", "0.1", "fedmho_md")]
    out = tmp_path / "fedmho.md"
    text = mho.filter_report(runs, out, "reduced")
    rows = {x.split(" | ")[2]: x for x in text.splitlines() if x.startswith("| MNIST | Dir(0.1)")}
    assert rows["FedMHO"] == ("| MNIST | Dir(0.1) | FedMHO | 80.00 (-2.00) n=2 | - | 82.00 n=2 | - | - | "
                              "R_th 0.8 (Table 4) |")
    assert rows["FedMHO-SD"] == ("| MNIST | Dir(0.1) | FedMHO-SD | 73.00 (-1.00) n=2 | - | 74.00 n=2 | - | "
                                 "75.00 (+3.00) | no filter (4,800) |")
    assert "R_th 0.8 (Table 4) in 1 of 3, no filter (4,800) in 2 of 3" in text
    assert "MD and SD lose 0.56-5.91 points" in text  # Table 4 minus Table 6 of the paper
    assert mho._mean_differences(pairs, "mnist", "fedmho_md") == [(0.4, -1.0), (0.8, 0.0), (1.0, 2.0)]
    figure = tmp_path / "fedmho-filter-reduced.png"
    assert figure.stat().st_size > 0 and f"]({figure.name})" in text
    assert mho.filter_report(runs, out, "vgg9-e10") == ""  # no ablation cells in that budget: no section
    mho.write_results(runs, out)
    text = out.read_text()
    assert text.index("## Budget `reduced`") < text.index("### Table 8, MNIST: R_th = 0.4") < \
        text.index("### The K-means filter")  # inside its budget's section, after that budget's tables


def test_fedmho_kd_cost_points_fit_and_figure(tmp_path):
    from hetfl.reproduce import fedmho as mho

    runs = tmp_path / "runs"
    for seed, (w0, ours) in enumerate([(50.0, 80.0), (70.0, 80.0), (78.0, 80.0)]):
        cfg = mho.cell_config("mnist", "0.1", seed, "reduced")
        gap = ours - w0
        results = {"fedmho": {"accuracy": ours, "best_accuracy": ours, "init_accuracy": w0},
                   "fedmho_md": {"accuracy": ours - (1.0 + 0.5 * gap), "best_accuracy": ours},  # cost = 1 + gap / 2
                   "fedmho_sd": {"accuracy": ours + 1.0, "best_accuracy": ours + 1.0}}  # above FedMHO: cost -1
        (runs / cfg["name"]).mkdir(parents=True)
        (runs / cfg["name"] / "summary.json").write_text(json.dumps({"config": cfg, "results": results}))
    cfg = mho.cell_config("fmnist", "0.1", 0, "reduced")  # no w_0 recorded: no point
    (runs / cfg["name"]).mkdir(parents=True)
    (runs / cfg["name"] / "summary.json").write_text(json.dumps(
        {"config": cfg, "results": {"fedmho": {"accuracy": 60.0, "best_accuracy": 60.0},
                                    "fedmho_md": {"accuracy": 50.0, "best_accuracy": 50.0}}}))
    points = mho.kd_costs(mho._cells(runs, "reduced"))
    assert sorted(points["fedmho_md"]) == [(2.0, 2.0), (10.0, 6.0), (30.0, 16.0)]
    assert sorted(points["fedmho_sd"]) == [(2.0, -1.0), (10.0, -1.0), (30.0, -1.0)]
    assert set(points) == {"fedmho_md", "fedmho_sd"}  # the Fashion cell without w_0 added nothing
    out = tmp_path / "fedmho.md"
    text = mho.kd_cost_report(runs, out)
    md = next(x for x in text.splitlines() if x.startswith("| FedMHO-MD |"))
    assert md == "| FedMHO-MD | 3 | 8.00 | 3 of 3 | +1.00 +0.500 x | 1.00 |"
    sd = next(x for x in text.splitlines() if x.startswith("| FedMHO-SD |"))
    assert sd == "| FedMHO-SD | 3 | -1.00 | 0 of 3 | - | - |"  # a constant cost has no correlation
    assert "MD/SD above FedMHO by 1.55-8.90 points" in text  # from the paper's Table 4
    figure = tmp_path / "fedmho-kd-cost-reduced.png"
    assert figure.stat().st_size > 0 and f"]({figure.name})" in text
    mho.write_results(runs, out)
    assert "### What the KD term costs FedMHO (budget `reduced`)" in out.read_text()


def test_fedmho_kd_cost_against_the_teachers_agreement(tmp_path):
    from hetfl.reproduce import fedmho as mho

    runs = tmp_path / "runs"
    budget = "vgg9-e10-feddf-partition"
    for seed, agree in enumerate([30.0, 50.0, 70.0]):  # MD's cost = 20 - 0.4 x agreement: pays above 50 %
        cfg = mho.cell_config("fmnist", "0.3", seed, budget)
        teacher = {"entropy": 1.0, "agreement": agree, "agreement_per_class": [agree] * 10}
        results = {"fedmho": {"accuracy": 60.0, "best_accuracy": 60.0, "init_accuracy": 40.0},
                   "fedmho_md": {"accuracy": 60.0 - (20.0 - 0.4 * agree), "best_accuracy": 60.0, "teacher": teacher},
                   "fedmho_sd": {"accuracy": 61.0, "best_accuracy": 61.0, "teacher": {**teacher, "agreement": None}}}
        (runs / cfg["name"]).mkdir(parents=True)
        (runs / cfg["name"] / "summary.json").write_text(json.dumps({"config": cfg, "results": results}))
    cfg = mho.cell_config("mnist", "0.3", 0, budget)  # no plain FedMHO: no point
    (runs / cfg["name"]).mkdir(parents=True)
    (runs / cfg["name"] / "summary.json").write_text(json.dumps(
        {"config": cfg, "results": {"fedmho_md": {"accuracy": 50.0, "best_accuracy": 50.0,
                                                  "teacher": {"entropy": 1.0, "agreement": 90.0}}}}))
    points = mho.kd_teacher_points(mho._cells(runs, budget))
    assert points == {("fedmho_md", "fmnist"): [(30.0, 8.0), (50.0, 0.0), (70.0, -8.0)]}  # no agreement: no SD point
    out = tmp_path / "fedmho.md"
    text = mho.kd_cost_report(runs, out)
    row = next(x for x in text.splitlines() if x.startswith("| FedMHO-MD | FMNIST |"))
    assert row == "| FedMHO-MD | FMNIST | 3 | 30.0-70.0 | +20.00 -0.400 x | -1.00 | 50.0 % |"
    figure = tmp_path / f"fedmho-kd-teacher-{budget}.png"
    assert figure.stat().st_size > 0 and f"]({figure.name})" in text


def test_fedmho_lead_over_fedcvae_against_w0_fits_within_each_setting(tmp_path):
    from hetfl.reproduce import fedmho as mho

    runs = tmp_path / "runs"
    # MD - FedCVAE-Ens = 2 w_0 + a per-setting offset: exact within a setting, not pooled
    data = {("0.5", 0): 40.0, ("0.5", 1): 50.0, ("0.1", 0): 20.0, ("0.1", 1): 26.0}
    for (setting, seed), w0 in data.items():
        cfg = mho.cell_config("fmnist", setting, seed, "reduced")
        lead = 2 * w0 + (-90.0 if setting == "0.5" else -30.0)
        results = {"fedmho": {"accuracy": 60.0, "best_accuracy": 60.0, "init_accuracy": w0},
                   "fedmho_md": {"accuracy": 60.0 + lead, "best_accuracy": 60.0},
                   "fedcvae_ens": {"accuracy": 60.0, "best_accuracy": 60.0}}
        (runs / cfg["name"]).mkdir(parents=True)
        (runs / cfg["name"] / "summary.json").write_text(json.dumps({"config": cfg, "results": results}))
    cfg = mho.cell_config("fmnist", "0.3", 0, "reduced")  # no FedCVAE-Ens: no point
    (runs / cfg["name"]).mkdir(parents=True)
    (runs / cfg["name"] / "summary.json").write_text(json.dumps({"config": cfg, "results": {
        "fedmho": {"accuracy": 1.0, "best_accuracy": 1.0, "init_accuracy": 99.0}}}))
    points = mho.generative_leads(mho._cells(runs, "reduced"))
    assert sorted(points["fedmho_md"]) == [("0.1", 20.0, 10.0), ("0.1", 26.0, 22.0), ("0.5", 40.0, -10.0),
                                           ("0.5", 50.0, 10.0)]
    assert sorted(points["fedmho"]) == [("0.1", 20.0, 0.0), ("0.1", 26.0, 0.0), ("0.5", 40.0, 0.0), ("0.5", 50.0, 0.0)]
    r, slope = mho.within_setting_fit(points["fedmho_md"])
    assert r == pytest.approx(1.0) and slope == pytest.approx(2.0)
    assert mho.within_setting_fit(points["fedmho"]) is None  # a constant lead has no correlation
    assert mho.within_setting_fit([("0.5", 1.0, 2.0), ("0.1", 3.0, 1.0)]) is None  # one point per setting
    out = tmp_path / "fedmho.md"
    text = mho.lead_report(runs, out)
    md = next(x for x in text.splitlines() if x.startswith("| FedMHO-MD, `reduced` |"))
    assert md.startswith("| FedMHO-MD, `reduced` | 4 | 34.0 (20.0-50.0) | 3 of 4 | 1.00, +2.00 | ")
    assert "FMNIST:" in text and "MNIST:" not in text.replace("FMNIST:", "")
    assert (tmp_path / "fedmho-lead-fmnist.png").stat().st_size > 0


def test_fedmho_local_epochs_section_pairs_each_seed_and_falls_back_on_the_grid_cell(tmp_path):
    from hetfl.reproduce import fedmho as mho

    archive = tmp_path / "fedmho-runs"
    (archive / "ablate").mkdir(parents=True)
    assert mho.epochs_report(archive) == ""  # no runs: no section

    def summary(epochs: int, w0: float, md: float, ens: float) -> str:
        cfg = {"client": {"epochs": epochs}}
        return json.dumps({"config": cfg, "results": {
            "fedmho": {"accuracy": 70.0, "init_accuracy": w0}, "fedmho_md": {"accuracy": md},
            "fedmho_sd": {"accuracy": md + 1}, "fedcvae_ens": {"accuracy": ens}}})

    (archive / "ablate" / "fedmho-E5-fmnist-a0.5-s0.json").write_text(summary(5, 60.0, 65.0, 70.0))
    (archive / "ablate" / "fedmho-E50-fmnist-a0.5-s0.json").write_text(summary(50, 70.0, 73.0, 70.0))
    (archive / "ablate" / "fedmho-E50-fmnist-a0.5-s1.json").write_text(summary(50, 66.0, 69.0, 70.0))
    (archive / "ablate" / "fedmho-E50-fmnist-a0.1-s0.json").write_text(summary(50, 30.0, 40.0, 70.0))
    (archive / "fedmho-fmnist-a0.5-s1-reduced.json").write_text(summary(5, 60.0, 63.0, 71.0))  # s1's E = 5
    (archive / "fedmho-fmnist-a0.5-s0-reduced.json").write_text(summary(5, 0.0, 0.0, 0.0))  # s0 has its own run
    (archive / "ablate" / "fedmho-freezebn-fmnist-a0.5.json").write_text("{}")  # another experiment: ignored
    rows = mho.epoch_runs(archive)
    assert [(r["setting"], r["seed"], r["epochs"], r["source"]) for r in rows] == [
        ("0.5", 0, 5, "run"), ("0.5", 0, 50, "run"), ("0.5", 1, 5, "grid cell"), ("0.5", 1, 50, "run"),
        ("0.1", 0, 50, "run")]  # SETTINGS order; no grid cell of a0.1 s0 in the archive
    text = mho.epochs_report(archive)
    assert "| FMNIST | Dir(0.5) | 1 | 5 | grid cell | 60.00 | 70.00 | 63.00 | 64.00 | 71.00 | -8.00 | -7.00 |" in text
    # w_0 +10 and +6, MD +8 and +6; at E = 50 MD is above FedCVAE-Ens in seed 0 (73 > 70), not seed 1 (69)
    assert "| FMNIST | Dir(0.5) | 5 to 50 | 2 | +8.00 | +7.00 | +7.00 | 1 of 2 | 1 of 2 |" in text
    assert "| FMNIST | Dir(0.1) | 50 | 1 | - | - | - | 0 of 1 | 0 of 1 |" in text


def test_fedmho_local_epochs_at_the_vgg9_scale_pair_each_e50_cell_with_its_e10_cell(tmp_path):
    from hetfl.reproduce import fedmho as mho

    archive = tmp_path / "fedmho-runs"
    archive.mkdir()

    def write(budget: str, alpha: float, seed: int, epochs: int, w0: float, md: float, ens: float | None,
              variant: str = "") -> None:
        name = f"fedmho-fmnist-a{alpha:g}{variant}-s{seed}-{budget}"
        cfg = {"name": name, "dataset": "fmnist", "seed": seed, "partition": {"alpha": alpha},
               "client": {"epochs": epochs}}
        results = {"fedmho": {"accuracy": 60.0, "init_accuracy": w0}, "fedmho_md": {"accuracy": md},
                   "fedmho_sd": {"accuracy": md - 1}}
        if ens is not None:
            results["fedcvae_ens"] = {"accuracy": ens}
        (archive / f"{name}.json").write_text(json.dumps({"config": cfg, "results": results}))

    write("vgg9-e10", 0.5, 0, 10, 40.0, 66.0, 70.0)
    write("vgg9-e10", 0.5, 1, 10, 0.0, 0.0, 0.0)  # no e50 cell of seed 1: not shown
    write("vgg9-e50", 0.5, 0, 50, 50.0, 71.0, None)  # FedCVAE-Ens from the e10 cell
    write("vgg9-e50", 0.3, 0, 50, 45.0, 60.0, 65.0)  # no e10 cell: shown alone
    write("vgg9-e50", 0.5, 0, 50, 0.0, 0.0, 0.0, variant="-nofilter")  # another variant: ignored
    rows = mho.vgg9_epoch_runs(archive)
    assert [(r["setting"], r["seed"], r["epochs"], r["fedcvae_ens"]) for r in rows] == [
        ("0.5", 0, 10, 70.0), ("0.5", 0, 50, 70.0), ("0.3", 0, 50, 65.0)]
    assert rows[1]["source"] == "`vgg9-e50` cell (FedCVAE-Ens of `vgg9-e10`)"
    text = mho.epochs_report(archive)
    assert "(VGG-9 classifiers, budgets `vgg9-e10` and `vgg9-e50`)" in text and "budget `reduced`" not in text
    assert "| FMNIST | Dir(0.5) | 0 | 50 | `vgg9-e50` cell (FedCVAE-Ens of `vgg9-e10`) | 50.00 | 60.00 | 71.00 | " \
           "70.00 | 70.00 | +1.00 | +0.00 |" in text
    assert "| FMNIST | Dir(0.5) | 10 to 50 | 1 | +10.00 | +5.00 | +5.00 | 1 of 1 | 0 of 1 |" in text
    assert "| FMNIST | Dir(0.3) | 50 | 1 | - | - | - | 0 of 1 | 0 of 1 |" in text


def test_fedmho_budgets_on_the_authors_partition_use_feddf_dirichlet_and_the_others_keep_dirichlet():
    from hetfl.reproduce import fedmho as mho

    authors = {"kind": "feddf_dirichlet", "alpha": 0.3}
    for budget in ("paper", "reduced-feddf-partition", "vgg9-e10-feddf-partition"):
        cfg = mho.cell_config("fmnist", "0.3", 2023, budget)
        assert cfg["partition"] == authors and cfg["name"] == f"fedmho-fmnist-a0.3-s2023-{budget}"
    for budget in ("reduced", "vgg9-e10", "vgg9-e50"):
        assert mho.cell_config("fmnist", "0.3", 0, budget)["partition"] == {"kind": "dirichlet", "alpha": 0.3,
                                                                             "min_size": "half"}
    # the new budgets differ from theirs in the partition alone
    new, old = mho.BUDGETS["reduced-feddf-partition"], mho.BUDGETS["reduced"]
    assert {**new, "partition": None} == {**old, "partition": None}


def test_fedmho_trials_section_names_each_trials_changed_settings_and_groups_trials_by_uploads(tmp_path):
    from hetfl.reproduce import fedmho as mho

    archive = tmp_path / "fedmho-runs"
    (archive / mho.TRIALS).mkdir(parents=True)
    assert mho.trials_report(archive) == ""  # no trials: no section

    def write(trial: str, method: str, changes: dict, digest: str, curve: list, threads: int = 1,
              teacher: dict | None = None) -> None:
        cfg = mho.cell_config("fmnist", "0.5", 0, "vgg9-e10", methods=(method,))
        cfg["methods"][method].update(changes)
        result = {"accuracy": curve[-1], "best_accuracy": max(curve[1:]), "init_accuracy": curve[0],
                  "curve": curve, "uploads_sha256": digest * 8, "server_seconds": 600.0}
        if teacher:
            result["teacher"] = teacher
        summary = {"config": cfg, "results": {method: result, f"{method}[init]": {"accuracy": curve[0]}},
                   "environment": {"threads": threads}}
        (archive / mho.TRIALS / f"{cfg['name']}-{trial}.json").write_text(json.dumps(summary))

    curve = [30.0, 50.0, 60.0, 62.0, 64.0, 66.0, 68.0]  # last five epochs: mean 64
    write("md-base", "fedmho_md", {}, "bbbbbbbb", curve, threads=2)
    blind = {"entropy": 1.234, "max_entropy": 2.3026, "agreement": 50.0, "agreement_per_class": [100.0, 0.0, 50.0, 0.0]}
    write("md-rnd", "fedmho_md", {"init": "random"}, "bbbbbbbb", [10.0, *curve[1:]], teacher=blind)
    write("md-c40", "fedmho_md", {"cvae_epochs": 40}, "aaaaaaaa", curve)
    write("base", "fedmho", {}, "bbbbbbbb", curve)
    (archive / mho.TRIALS / "notes.txt").write_text("not a summary")
    rows = mho.trial_rows(archive)
    assert [(r["trial"], r["method"], r["changed"]) for r in rows] == [
        ("md-c40", "fedmho_md", {"cvae_epochs": 40}),  # other uploads first (sorted by digest)
        ("base", "fedmho", {}), ("md-base", "fedmho_md", {}), ("md-rnd", "fedmho_md", {"init": "random"})]
    assert rows[2]["last5"] == pytest.approx(64.0) and rows[2]["minutes"] == pytest.approx(10.0)
    text = mho.trials_report(archive)
    assert "| FMNIST Dir(0.5) s0 `vgg9-e10` | md-base | FedMHO-MD | none | bbbbbbbb | 2 | 30.00 | 68.00 | 68.00 | " \
           "64.00 | 10.0 | - |" in text  # no teacher record: a dash
    assert "| md-rnd | FedMHO-MD | `init: \"random\"` | bbbbbbbb | 1 | 10.00 |" in text
    assert "| 10.0 | H 1.23 nats, agrees 50.0 %, never on 1, 3 |" in text
    assert "[init]" not in text
    # a method without a curve in its results (DENSE): the run's logged ``curves`` (step, %) give "last 5"
    cfg = mho.cell_config("fmnist", "0.5", 0, "vgg9-e10", methods=("dense",))
    cfg["methods"]["dense"]["epochs"] = 6
    logged = [[step, acc] for step, acc in enumerate([10.0, 20.0, 40.0, 50.0, 60.0, 70.0], start=1)]
    summary = {"config": cfg, "results": {"dense": {"accuracy": 70.0, "best_accuracy": 70.0, "server_seconds": 60.0,
                                                    "uploads_sha256": "b" * 64}},
               "curves": {"dense": logged}}
    (archive / mho.TRIALS / f"{cfg['name']}-dense-e6.json").write_text(json.dumps(summary))
    (row,) = [r for r in mho.trial_rows(archive) if r["method"] == "dense"]
    assert row["changed"] == {"epochs": 6} and row["last5"] == pytest.approx(48.0) and row["w0"] is None


def test_client_sweep_section_rows_per_k_with_k5_from_the_same_seeds_and_a_figure(tmp_path):
    folder = tmp_path / "fedhydra-runs" / paper.ONE_CACHE
    folder.mkdir(parents=True)
    methods = ("ensemble", "fedavg", "ot", "feddf", "dense", "coboosting", "fedhydra_dense_log1p")
    # (K, seed): accuracy of every method; ours above the baselines except at K = 50
    cells = {(5, 0): 80.0, (5, 1): 10.0, (10, 0): 70.0, (50, 0): 50.0}
    for (k, seed), acc in cells.items():
        cfg = paper.cell_config("mnist", "0.5", seed, "reduced", clients=k)
        accs = {m: acc for m in methods} | {"fedhydra_dense_log1p": acc + (-5.0 if k == 50 else 5.0)}
        results = {m: {"accuracy": a - 1, "best_accuracy": a} for m, a in accs.items()}
        if k != 50:  # ours ran today's defaults (its params say so) but at K = 50; DENSE and Co-Boosting never
            results["fedhydra_dense_log1p"]["params"] = {"pool_shuffle": True}
        (folder / f"{cfg['name']}.json").write_text(json.dumps({"config": cfg, "results": results, "minutes": k / 5}))
    assert paper.cell_config("mnist", "0.5", 0, "reduced", clients=10)["name"] == "fedhydra-mnist-0.5-m10-s0-reduced"
    text = paper.client_sweep_report(paper.sweep_cells(tmp_path / "runs", tmp_path / "fedhydra.md", "reduced"))
    lines = text.splitlines()
    assert lines[0] == "## Client-count sweep (Tables 4 and 7 protocol, budget `reduced`)"
    rows = [x for x in lines if x.startswith("| 5 |") or x.startswith("| 10 |") or x.startswith("| 50 |")]
    assert [r.split(" |")[0] for r in rows] == ["| 5", "| 10", "| 50"]  # ours, in K order
    assert rows[0].startswith("| 5 | 80.00 (79.00) n=1 |")  # seed 0 only: seed 1 did not sweep
    assert rows[2].endswith("| 45.00 (44.00) n=1 † | 10.00 |")  # ours (older defaults), then the cell's minutes
    assert rows[1].endswith("| 70.00 (69.00) n=1 † | 75.00 (74.00) n=1 | 2.00 |")  # Co-Boosting †, ours not
    footnotes = [x for x in lines if x.startswith("† ")]
    assert len(footnotes) == 3 and any(x.startswith("† Ours (FedHydra in DENSE's loop") for x in footnotes)
    verdict = next(x for x in lines if x.startswith("`fedhydra_dense_log1p` against"))
    assert "K = 10: above FedAvg (75.00 vs 70.00)" in verdict and "K = 50: below FedAvg (45.00 vs 50.00)" in verdict
    assert verdict.endswith("Per (K, seed): above every baseline run in 2 of 3.")  # K = 5 and 10 of seed 0
    assert "| SVHN (Table 4) | 100 | 23.69 | 35.23 | 50.37 | 48.87 | 53.64 | 60.01 |" in lines
    assert "| CIFAR-10 (Table 7) | 5 | 38.26 |" in text
    # the Table 1 sections leave the sweep cells out; the results file links one figure per sweep
    assert "m10" not in paper.one_cache_report(folder) and "| 70.00" not in paper.one_cache_report(folder)
    out = tmp_path / "fedhydra.md"
    paper.write_results(tmp_path / "runs", out)
    png = paper.client_sweep_figure_path(out, "mnist", "0.5", "reduced")
    assert png.stat().st_size > 0 and f"]({png.name})" in out.read_text()
    assert paper.client_sweep_report(paper.sweep_cells(tmp_path / "runs", tmp_path / "other.md", "reduced")) == ""
    # a later one-cache grid that ran the Table 1 cell of seed 0 gives K = 5 (the other cells stay)
    grid = tmp_path / "fedhydra-runs" / f"{paper.LATER_GRID}amd"
    grid.mkdir()
    cfg = paper.cell_config("mnist", "0.5", 0, "reduced")
    later = {m: {"accuracy": 89.0, "best_accuracy": 90.0, "params": {"pool_shuffle": True}} for m in methods}
    (grid / f"{cfg['name']}.json").write_text(json.dumps({"config": cfg, "results": later, "minutes": 1.0}))
    regrid = paper.client_sweep_report(paper.sweep_cells(tmp_path / "runs", out, "reduced")).splitlines()
    assert next(x for x in regrid if x.startswith("| 5 |")).startswith("| 5 | 90.00 (89.00) n=1 |")
    assert [x for x in regrid if x.startswith("| 10 |")] == [rows[1]]
    shutil.rmtree(grid)
    # a sweep run with the default results file is archived beside it, not in one-cache: still reported
    for f in folder.glob("*.json"):
        f.rename(folder.parent / f.name)
    assert paper.client_sweep_report(paper.sweep_cells(tmp_path / "runs", out, "reduced")) == text


def test_client_sweep_figure_gives_each_method_one_colour_in_both_panels():
    colours = [paper._sweep_color(m) for m in (*paper.METHODS, *paper.EXTRA)]
    assert len(set(colours)) == len(colours) and "gray" not in colours
    assert paper._sweep_color("ensemble") == "gray"
    assert paper._sweep_color("feddf") == "C2"  # FedDF's line in ours and in the paper's Table 4 panel


def test_generator_free_baselines_carry_over_between_budgets_only_on_the_same_uploads(tmp_path):
    folder = tmp_path / "fedhydra-runs" / paper.ONE_CACHE
    folder.mkdir(parents=True)

    def write(budget: str, accs: dict[str, float], feddf_steps: int | None = None, digest: str | None = None) -> None:
        cfg = paper.cell_config("fmnist", "0.01", 0, budget)
        if feddf_steps is not None:
            cfg["methods"]["feddf"]["steps"] = feddf_steps
        results = {m: {"accuracy": a - 1, "best_accuracy": a} for m, a in accs.items()}
        if digest is not None:  # the uploads' sha256, recorded by newer runs in every one-shot method's result
            results = {m: {**r, "uploads_sha256": digest} for m, r in results.items()}
        (folder / f"{cfg['name']}.json").write_text(json.dumps({"config": cfg, "results": results}))

    write("reduced-t60", {"ensemble": 30.0, "fedavg": 40.0, "ot": 20.0, "feddf": 45.0, "fedhydra_dense_log1p": 44.0})
    g30 = {"ensemble": 30.0, "fedavg": 40.0, "dense": 30.0, "coboosting": 35.0, "fedhydra_dense_log1p": 50.0}
    write("reduced-t60-g30", g30)
    section = paper.one_cache_report(folder, "reduced-t60-g30").splitlines()
    row = {x.split(" | ")[0]: x for x in section if x.startswith("| ")}
    assert "| 20.00 (19.00) n=1 from `reduced-t60` | 39.56 |" in row["| OT"]
    assert "| 45.00 (44.00) n=1 from `reduced-t60` |" in row["| FedDF"]
    assert "from" not in row["| DENSE"] and "from" not in row["| FedAvg"]
    verdict = next(x for x in section if x.startswith("- 0.01"))
    assert verdict.startswith("- 0.01 (n=1): `fedhydra_dense_log1p` first (50.00 vs best baseline 45.00)")
    assert "not compared" not in verdict
    assert "| 45.00 FedDF |" in next(x for x in paper.standing_report(folder).splitlines() if "| α=0.01 |" in x
                                     and x.startswith("| FMNIST"))
    # the source budget's own section is unchanged (nothing carried into a cell that ran the method)
    t60_rows = [x for x in paper.one_cache_report(folder, "reduced-t60").splitlines() if x.startswith("| ")]
    assert t60_rows and not any("from `" in x for x in t60_rows)
    # other uploads (FedAvg differs by a digit): nothing carried, and the verdict says what it lacks
    write("reduced-t60-g30", {**g30, "fedavg": 40.01})
    verdict = next(x for x in paper.one_cache_report(folder, "reduced-t60-g30").splitlines() if x.startswith("- 0.01"))
    assert "not compared: OT, FedDF (not run in every cell)" in verdict
    # same uploads, but FedDF ran with other parameters there: only OT carries over
    write("reduced-t60-g30", g30)
    write("reduced-t60", {"ensemble": 30.0, "fedavg": 40.0, "ot": 20.0, "feddf": 45.0}, feddf_steps=5)
    verdict = next(x for x in paper.one_cache_report(folder, "reduced-t60-g30").splitlines() if x.startswith("- 0.01"))
    assert "not compared: FedDF (not run in every cell)" in verdict
    # where both cells recorded their uploads' sha256, it decides: equal accuracies on other bytes carry nothing
    write("reduced-t60", {"ensemble": 30.0, "fedavg": 40.0, "ot": 20.0, "feddf": 45.0}, digest="a" * 64)
    write("reduced-t60-g30", g30, digest="b" * 64)
    verdict = next(x for x in paper.one_cache_report(folder, "reduced-t60-g30").splitlines() if x.startswith("- 0.01"))
    assert "not compared: OT, FedDF (not run in every cell)" in verdict
    write("reduced-t60-g30", g30, digest="a" * 64)
    section = paper.one_cache_report(folder, "reduced-t60-g30").splitlines()
    assert "not compared" not in next(x for x in section if x.startswith("- 0.01"))
    assert "Uploads: 1 of 1 cells record `uploads_sha256`; in each, every method" in "\n".join(section)
    # a cell whose methods record different digests is named in the report
    name = paper.cell_config("fmnist", "0.01", 0, "reduced-t60-g30")["name"]
    cell = json.loads((folder / f"{name}.json").read_text())
    cell["results"]["dense"]["uploads_sha256"] = "c" * 64
    (folder / f"{name}.json").write_text(json.dumps(cell))
    assert f"**methods ran on different uploads in {name}**" in paper.one_cache_report(folder, "reduced-t60-g30")


def test_fedmho_vgg9_budget_sets_client_precision_only_where_it_is_given():
    from hetfl.reproduce import fedmho as mho

    vgg = mho.cell_config("mnist", "0.1", 0, "vgg9-e10")
    assert vgg["client"]["model"] == ["vgg9"] * 5 + ["lenet5"] * 5 and vgg["server"]["model"] == "vgg9"
    assert vgg["client"]["precision"] == "bf16" and vgg["client"]["epochs"] == 10
    validate(vgg)
    reduced = mho.cell_config("mnist", "0.1", 0, "reduced")  # archived configs keep their exact keys
    assert "precision" not in reduced["client"]
    e50 = mho.cell_config("mnist", "0.1", 0, "vgg9-e50")  # the classifiers' training length alone differs
    validate(e50)
    assert e50["client"]["epochs"] == 50 and e50["name"].endswith("-vgg9-e50")
    assert {**e50, "name": vgg["name"], "client": {**e50["client"], "epochs": 10}} == vgg


@pytest.mark.parametrize("budget", ["reduced", "vgg9-e10", "vgg9-e50"])
@pytest.mark.parametrize("variant", ["main", "nofilter", "rth0.4", "curve"])
def test_fedmho_cell_variant_is_read_back_from_its_name_whatever_dashes_the_budget_holds(budget, variant):
    from hetfl.reproduce import fedmho as mho

    assert mho._variant(mho.cell_config("mnist", "0.1", 2, budget, variant=variant)) == variant


def test_partial_report_compares_reruns_with_their_archived_cells_and_lists_what_only_they_measured(tmp_path):
    from hetfl.reproduce.common import PARTIAL, partial_report

    def cell(name: str, results: dict) -> dict:
        return {"config": {"name": name}, "results": results}

    assert partial_report(tmp_path, {}) == ""  # no partial/ folder: no section
    (tmp_path / "cell-a.json").write_text(json.dumps(cell("cell-a", {
        "m1": {"accuracy": 80.0, "best_accuracy": 81.0, "uploads_sha256": "x"},
        "m2": {"accuracy": 70.0, "uploads_sha256": "x"}})))
    (tmp_path / "cell-c.json").write_text(json.dumps(cell("cell-c", {
        "m1": {"accuracy": 40.0, "uploads_sha256": "y"}, "m2": {"accuracy": 45.0}})))
    rerun = tmp_path / PARTIAL / "rerun"
    rerun.mkdir(parents=True)
    (rerun / "cell-a.json").write_text(json.dumps(cell("cell-a", {
        "m1": {"accuracy": 78.0, "best_accuracy": 79.0, "uploads_sha256": "x"},
        "m3": {"accuracy": 50.0, "best_accuracy": 52.0, "uploads_sha256": "x"}})))
    (rerun / "cell-c.json").write_text(json.dumps(cell("cell-c", {"m1": {"accuracy": 43.0, "uploads_sha256": "z"}})))
    old = tmp_path / PARTIAL / "old"
    old.mkdir()
    (old / "cell-b.json").write_text(json.dumps(cell("cell-b", {"m1": {"accuracy": 60.0}})))  # no archived cell-b
    plain = tmp_path / PARTIAL / "plain"
    plain.mkdir()
    (plain / "cell-a.json").write_text(json.dumps(cell("cell-a", {"m1": {"accuracy": 80.0}})))  # no digests
    text = partial_report(tmp_path, {"m3": "Method Three"})
    assert text.startswith("### Re-runs kept apart")
    assert "| `plain` | 1 | 0 of 1 (1 without digests) | 1 | 0.00 / +0.00 |" in text
    assert "| `old` | 1 | 0 of 1 (1 with no archived cell) | 0 | - |" in text
    # cell-a: same digests, m1 -2.00; cell-c: other uploads, m1 +3.00 -> mean |2.00, 3.00| = 2.50, largest +3.00
    assert "| `rerun` | 2 | 1 of 2 | 2 | 2.50 / +3.00 |" in text
    assert text.index("`old`") < text.index("`rerun`")
    only = text[text.index("Measured only in these re-runs"):]
    assert "| cell-a | Method Three | 50.00 (52.00) | `rerun` |" in only
    assert "| cell-b | m1 | 60.00 (60.00) | `old` |" in only
    assert "cell-a | m1" not in only and "cell-c" not in only  # methods the archived cells have


def test_replace_cell_keeps_the_earlier_copy_apart_and_the_report_sets_them_side_by_side(tmp_path):
    from hetfl.reproduce.common import PARTIAL, REPLACED_WHOLE, partial_report, replace_cell

    archive, runs = tmp_path / "archive", tmp_path / "runs"
    archive.mkdir()
    setting = {"dataset": "mnist", "seed": 0, "clients": 10, "partition": {"alpha": 0.1}}

    def cell(name: str, results: dict, **config) -> dict:
        here = results["fedavg"]["accuracy"] > 50  # the later runs ran here
        return {"config": {"name": name, **setting, **config}, "results": results,
                "environment": {"cpu": "here" if here else "there"}}

    earlier = {"fedavg": {"accuracy": 50.0, "uploads_sha256": "a"},
               "coboosting": {"accuracy": 60.0, "best_accuracy": 64.0, "uploads_sha256": "a"},  # no params: older
               "dense": {"accuracy": 40.0, "uploads_sha256": "a"}}
    for name in ("c-s0", "c-s1"):
        (archive / f"{name}.json").write_text(json.dumps({**cell(name, earlier), "note": "by hand"}))
    params = {"grad_clip": 10.0, "generator_grad_clip": 10.0, "pool_shuffle": True}
    later = {"fedavg": {"accuracy": 51.0, "uploads_sha256": "b"},
             "coboosting": {"accuracy": 66.0, "best_accuracy": 67.0, "params": params, "uploads_sha256": "b"},
             "dense": {"accuracy": 41.0, "best_accuracy": 42.0, "uploads_sha256": "b"}}

    def run(name: str, results: dict, **config) -> Path:
        (runs / name).mkdir(parents=True, exist_ok=True)
        (runs / name / "summary.json").write_text(json.dumps(cell(name, results, **config)))
        return runs / name

    with pytest.raises(ValueError, match="has not finished"):
        replace_cell(runs / "c-s0", archive, "before")
    with pytest.raises(ValueError, match="no archived cell named c-s9"):
        replace_cell(run("c-s9", later), archive, "before")
    with pytest.raises(ValueError, match=r"setting differs .*\['seed'\]"):
        replace_cell(run("c-s0", later, seed=1), archive, "before")
    with pytest.raises(ValueError, match=r"lacks \['dense'\]"):
        replace_cell(run("c-s0", {m: r for m, r in later.items() if m != "dense"}), archive, "before")
    assert json.loads((archive / "c-s0.json").read_text())["results"] == earlier  # refusals leave it alone

    target, kept = replace_cell(run("c-s0", later), archive, "before")
    assert target == archive / "c-s0.json" and kept == archive / PARTIAL / "before" / "c-s0.json"
    assert json.loads(target.read_text())["results"] == later
    assert "note" not in json.loads(target.read_text())  # the hand-written note stays with the run it was about
    old = json.loads(kept.read_text())
    assert old["results"] == earlier and old["note"] == "by hand"
    assert old[REPLACED_WHOLE]["environment"] == {"cpu": "here"}
    with pytest.raises(ValueError, match="already kept"):
        replace_cell(run("c-s0", later), archive, "before")
    later1 = {**later, "coboosting": {**later["coboosting"], "accuracy": 70.0, "best_accuracy": 71.0}}
    replace_cell(run("c-s1", later1), archive, "before")

    text = partial_report(archive, {"coboosting": "Co-Boosting"})
    # Δ is the later run (the archived cell) minus the earlier (kept): fedavg +1, coboosting +6/+10, dense +1;
    # the earlier copies ran both generator methods at their older defaults (no params recorded): †
    assert "| `before` | 2 | 0 of 2 | 6 | 3.33 / +10.00 |" in text  # mean |1, 6, 1, 1, 10, 1|
    whole = text[text.index("Cells that a later run of the whole cell replaced"):]
    assert "| `before` | Co-Boosting † | 2 | 64.00 (60.00) | 69.00 (68.00) | +5.00 | +8.00 |" in whole
    assert "| `before` | dense † | 2 | 40.00 (40.00) | 42.00 (41.00) | +2.00 | +1.00 |" in whole
    assert "| `before` | fedavg | 2 | 50.00 (50.00) | 51.00 (51.00) | +1.00 | +1.00 |" in whole


def test_replace_cell_in_a_subfolder_keeps_the_earlier_copy_in_the_archive_and_pairs_it_there(tmp_path):
    from hetfl.reproduce.common import PARTIAL, REPLACED_WHOLE, partial_report, partial_runs, replace_cell

    archive, runs = tmp_path / "archive", tmp_path / "runs"
    (archive / "one-cache").mkdir(parents=True)
    config = {"name": "c-m10-s0", "dataset": "mnist", "seed": 0, "clients": 10, "partition": {"alpha": 0.5}}
    earlier = {"config": config, "results": {"fedavg": {"accuracy": 50.0}, "dense": {"accuracy": 40.0}}}
    (archive / "one-cache" / "c-m10-s0.json").write_text(json.dumps(earlier))
    (archive / "c-m10-s0.json").write_text(json.dumps({**earlier, "results": {"fedavg": {"accuracy": 1.0}}}))
    (runs / "c-m10-s0").mkdir(parents=True)
    later = {"fedavg": {"accuracy": 52.0}, "dense": {"accuracy": 45.0, "best_accuracy": 46.0}}
    (runs / "c-m10-s0" / "summary.json").write_text(json.dumps({"config": config, "results": later}))

    with pytest.raises(ValueError, match="no archived cell named c-m10-s0"):
        replace_cell(runs / "c-m10-s0", archive, "before", folder="elsewhere")
    target, kept = replace_cell(runs / "c-m10-s0", archive, "before", folder="one-cache")
    assert target == archive / "one-cache" / "c-m10-s0.json" and kept == archive / PARTIAL / "before" / "c-m10-s0.json"
    assert json.loads(target.read_text())["results"] == later
    assert json.loads((archive / "c-m10-s0.json").read_text())["results"] == {"fedavg": {"accuracy": 1.0}}  # untouched
    assert json.loads(kept.read_text())[REPLACED_WHOLE]["folder"] == "one-cache"
    [(folder, summary, archived)] = partial_runs(archive)
    assert folder == "before" and summary["results"] == earlier["results"] and archived["results"] == later
    whole = partial_report(archive, {})
    whole = whole[whole.index("Cells that a later run of the whole cell replaced"):]
    assert "| `before` | dense † | 1 | 40.00 (40.00) | 46.00 (45.00) | +6.00 | +5.00 |" in whole  # no params: older


def test_curve_runs_report_finds_best_final_and_collapsed_epochs(tmp_path):
    from hetfl.reproduce.fedhydra import curve_run_rows, curve_runs_report

    folder = tmp_path / "runs" / "paper-server-curves"
    folder.mkdir(parents=True)
    assert curve_runs_report(folder, tmp_path / "r.md") == ""  # no runs.json: no section
    accs = [6.0, 45.0, 70.0, 10.0, 10.0, 62.0, 70.0, 9.9]  # early 6 % is not a collapse; the best's first epoch
    (folder / "a.jsonl").write_text("\n".join(
        json.dumps({"method": "dense", "step": i, "kd_loss": 1.0, "kd_grad_max": float(i), "accuracy": a})
        for i, a in enumerate(accs, 1)) + "\n" + json.dumps({"method": "dense", "step": -1, "accuracy": 9.9}) + "\n")
    (folder / "runs.json").write_text(json.dumps({"about": "test", "runs": [
        {"cell": "fmnist-0.5-s0", "method": "dense", "run": "call 1", "file": "a.jsonl"}]}))
    (row,) = curve_run_rows(folder, json.loads((folder / "runs.json").read_text())["runs"])
    assert (row["epochs"], row["best"], row["best_epoch"], row["final"]) == (8, 70.0, 3, 9.9)
    assert (row["collapsed"], row["first_collapse"], row["grad_max"]) == (3, 4, 8.0)
    assert (row["dead_max"], row["first_dead"], row["new_max"]) == (None, None, None)  # an older log
    assert row["tail"] == pytest.approx((39.95, 42.4971), abs=1e-3)  # the last quarter: epochs 7-8 (70, 9.9)
    (folder / "n.jsonl").write_text("\n".join(
        json.dumps({"method": "dense", "step": i, "kd_grad_max": 1.0, "kd_loss_new": new, "dead_units": dead,
                    "accuracy": 50.0}) for i, (new, dead) in enumerate([(3.0, 0.0), (50.0, 0.0), (4.0, 0.5)], 1)))
    (folder / "runs.json").write_text(json.dumps({"about": "test", "runs": [
        {"cell": "fmnist-0.5-s0", "method": "dense", "run": "call 1", "file": "a.jsonl"},
        {"cell": "fmnist-0.5-s0", "method": "dense", "run": "new", "file": "n.jsonl"}]}))
    body = curve_runs_report(folder, tmp_path / "r.md")
    assert "| fmnist-0.5-s0 | DENSE | call 1 | 8 | 70.00 (3) | 9.90 | 39.95 (42.50) | 3 (from 4) | 8.0 | - | - |" in (
        body)
    assert "| fmnist-0.5-s0 | DENSE | new | 3 | 50.00 (1) | 50.00 | 50.00 (0.00) | 0 | 1.0 | 0.50 (3) | 50.0 |" in body
    assert (tmp_path / "r-paper-server-curves.png").is_file()
    assert "### Our variant per change" not in body  # no run names a change
    (folder / "runs.json").write_text(json.dumps({"about": "test", "runs": [
        {"cell": "fmnist-0.5-s0, GPU", "method": "dense", "run": "call 1", "file": "a.jsonl", "change": "none"},
        {"cell": "fmnist-0.5-s0, GPU", "method": "dense", "run": "new", "file": "n.jsonl", "change": "lr"},
        {"cell": "fmnist-0.5-s0, CPU", "method": "dense", "run": "again", "file": "a.jsonl", "change": "none"},
        {"cell": "mnist-0.01-s0", "method": "dense", "run": "m", "file": "n.jsonl", "change": "lr"},
        {"cell": "fmnist-2cc-s0, CPU", "method": "dense", "run": "c", "file": "n.jsonl", "change": "lr"}]}))
    body = curve_runs_report(folder, tmp_path / "r.md")
    FIFTY = "50.00 (50.00-50.00) | " * 3  # best, final and last-quarter means of one run at 50 % throughout
    # fmnist alpha 0.5: paper 77.20; the two "none" runs share a cell before the comma
    assert ("| fmnist-0.5-s0 | none | 2 | 8 | 2 of 2 | 70.00 (70.00-70.00) | 9.90 (9.90-9.90) | 39.95 (39.95-39.95) "
            "| 77.20 | 0.0 |") in body
    assert f"| fmnist-0.5-s0 | lr | 1 | 3 | 0 of 1 | {FIFTY}77.20 | 0.0 |" in body
    # mnist alpha 0.01: paper 38.83, so all three epochs at 50 % are above it
    assert f"| mnist-0.01-s0 | lr | 1 | 3 | 0 of 1 | {FIFTY}38.83 | 3.0 |" in body
    # a 2c/c cell (named 2cc): the paper's Fashion-MNIST 2c/c, 39.06
    assert f"| fmnist-2cc-s0 | lr | 1 | 3 | 0 of 1 | {FIFTY}39.06 | 3.0 |" in body
    assert body.index("| fmnist-0.5-s0 | none |") < body.index("| fmnist-0.5-s0 | lr |")  # in the order first met
    (folder / "b.jsonl").write_text(json.dumps({"method": "dense", "step": 1, "kd_loss": 1.0}) + "\n")
    with pytest.raises(ValueError, match="b.jsonl: no evaluated epoch of dense"):
        curve_run_rows(folder, [{"cell": "c", "method": "dense", "run": "r", "file": "b.jsonl"}])


def test_twin_table_compares_a_run_with_its_twin_over_the_common_epochs(tmp_path):
    """A bf16 probe beside its stopped fp32 twin: both are cut to the epochs both evaluated; best (first
    epoch), mean, last quarter and last value per side, and Δ of the means; bad twins are refused."""
    from hetfl.reproduce.fedhydra import curve_run_rows, curve_runs_report, twin_rows

    folder = tmp_path / "paper-server-curves"
    folder.mkdir()

    def log(name: str, accs: list[float], method: str = "coboosting") -> None:
        (folder / name).write_text("".join(json.dumps({"method": method, "step": i, "accuracy": a}) + "\n"
                                           for i, a in enumerate(accs, 1)))

    log("bf16.jsonl", [20.0, 40.0, 30.0, 30.0, 10.0, 99.0])  # epoch 6 is past the twin's last epoch
    log("fp32.jsonl", [30.0, 30.0, 50.0, 30.0, 20.0])
    log("dense.jsonl", [1.0, 2.0], method="dense")
    runs = [{"cell": "mnist-2cc-s0, H200", "method": "coboosting", "run": "fp32 (stopped)", "file": "fp32.jsonl"},
            {"cell": "mnist-2cc-s0, H200", "method": "coboosting", "run": "bf16", "file": "bf16.jsonl",
             "twin": "fp32.jsonl"},
            {"cell": "mnist-2cc-s0, H200", "method": "dense", "run": "d", "file": "dense.jsonl"}]
    (t,) = twin_rows(curve_run_rows(folder, runs))
    assert (t["file"], t["twin_file"], t["common"], t["last_epoch"]) == ("bf16.jsonl", "fp32.jsonl", 5, 5)
    assert t["run"] == {"best": 40.0, "best_epoch": 2, "mean": 26.0, "tail": 10.0, "last": 10.0}
    assert t["twin"] == {"best": 50.0, "best_epoch": 3, "mean": 32.0, "tail": 20.0, "last": 20.0}
    assert t["delta"] == pytest.approx(-6.0)
    (folder / "runs.json").write_text(json.dumps({"about": "", "runs": runs}))
    body = curve_runs_report(folder, tmp_path / "r.md")
    assert ("| mnist-2cc-s0, H200 | Co-Boosting | `bf16.jsonl` | `fp32.jsonl` | 5 (to 5) | 40.00 (2) / 50.00 (3) | "
            "26.00 / 32.00 | -6.00 | 10.00 / 20.00 | 10.00 / 20.00 |") in body
    for twin, match in (("nope.jsonl", "not another run listed"), ("bf16.jsonl", "not another run listed"),
                        ("dense.jsonl", "ran dense, not coboosting")):
        bad = [*runs[:1], {**runs[1], "twin": twin}, runs[2]]
        with pytest.raises(ValueError, match=match):
            twin_rows(curve_run_rows(folder, bad))
    log("late.jsonl", [])
    (folder / "late.jsonl").write_text(json.dumps({"method": "coboosting", "step": 9, "accuracy": 1.0}) + "\n")
    late = [*runs[:1], {**runs[1], "file": "late.jsonl"}]
    with pytest.raises(ValueError, match="no epoch evaluated in both"):
        twin_rows(curve_run_rows(folder, late))


def test_curve_runs_figure_lays_out_many_long_legends_without_warnings(tmp_path):
    """Rows of one short legend, then rows of a dozen long-labelled runs per panel (as the archive has):
    the figure is laid out (tight_layout warned "not applied" here and let the legends run over the next
    row's titles) and written."""
    import warnings

    from hetfl.reproduce.fedhydra import plot_curve_runs

    label = "stopped by the device's deadline after many epochs on a lent accelerator, beside other runs " * 3
    rows = [{"cell": f"short{c}", "method": "dense", "run": "call 1", "curve": [[1, 10.0], [2, 50.0]]}
            for c in range(6)]
    rows += [{"cell": f"long{c}", "method": "dense", "run": f"{label}{i}", "curve": [[1, 10.0], [2, 50.0 + i]]}
             for c in range(3) for i in range(12)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = plot_curve_runs(rows, tmp_path / "curves.png")
    assert out == tmp_path / "curves.png" and out.stat().st_size > 0


def test_tail_stats_takes_the_last_quarter():
    from hetfl.reproduce.fedhydra import tail_stats

    assert tail_stats([1.0] * 150 + [10.0, 20.0] * 25) == pytest.approx((15.0, 5.0508), abs=1e-4)  # last 50 of 200
    assert tail_stats([7.0, 3.0]) == (3.0, 0.0)  # fewer than 4 epochs: the last one, sd 0
    with pytest.raises(ValueError, match="at least one accuracy"):
        tail_stats([])


def test_same_uploads_compares_digests_method_by_method():
    from hetfl.reproduce.common import same_uploads

    cfg = {"dataset": "fmnist", "seed": 0, "clients": 10, "partition": {"kind": "dirichlet", "alpha": 0.5},
           "client": {"model": "vgg9"}, "server": {"model": "vgg9"}}

    def cell(**digests: str) -> dict:
        return {"config": cfg, "results": {m: {"accuracy": 1.0, "uploads_sha256": d} for m, d in digests.items()}}

    full = cell(fedmho="cvae", fedmho_md="cvae", fedavg="clf", feddf="clf")  # two kinds of upload in one cell
    part = cell(fedmho="cvae", fedavg="clf")
    assert same_uploads(full, part) and same_uploads(part, full)
    assert same_uploads(cell(dense="clf"), full)  # a method the cell lacks, on one of the cell's uploads
    assert not same_uploads(full, cell(fedmho="cvae", fedavg="other"))
    assert not same_uploads(cell(dense="other"), full)
    assert not same_uploads(cell(fedmho="cvae", dense="other"), full)  # one digest the cell never had
    assert not same_uploads(full, {**cell(fedmho="cvae"), "config": {**cfg, "seed": 1}})


def test_merge_methods_adds_results_run_elsewhere_on_the_same_uploads_only(tmp_path):
    from hetfl.reproduce.common import merge_methods

    cfg = {"dataset": "fmnist", "seed": 0, "clients": 5, "partition": {"kind": "dirichlet", "alpha": 0.5},
           "client": {"model": "cnn2"}, "server": {"model": "cnn2"}, "methods": {"fedavg": {}, "ot": {}}}
    result = {"accuracy": 57.5, "best_accuracy": 57.5, "uploads_sha256": "ab"}
    cell = {"config": cfg, "results": {"fedavg": result, "ot": {**result, "accuracy": 61.5}}, "note": "GPU"}
    archived = tmp_path / "cell.json"
    archived.write_text(json.dumps(cell))
    run = {"config": {**cfg, "methods": {"dense": {"epochs": 200}, "ot": {"x": 1}}},
           "results": {"dense": {**result, "accuracy": 63.3}, "ot": {**result, "accuracy": 1.0}}}
    assert merge_methods(archived, run, ["dense"]) == ["dense"]
    merged = json.loads(archived.read_text())
    assert merged["results"]["dense"]["accuracy"] == 63.3 and merged["results"]["ot"]["accuracy"] == 61.5
    assert merged["config"]["methods"]["dense"] == {"epochs": 200} and merged["note"] == "GPU"
    with pytest.raises(ValueError, match="ot ran with {'x': 1}, the archived cell with {}"):
        merge_methods(archived, run, ["ot"])  # another config of a method the cell has
    other = {**run, "results": {"dense": {**result, "uploads_sha256": "cd"}}}
    with pytest.raises(ValueError, match="did not run on the archived cell's uploads"):
        merge_methods(archived, other, ["dense"])
    with pytest.raises(ValueError, match="did not run on the archived cell's uploads"):
        merge_methods(archived, {**run, "config": {**run["config"], "seed": 1}}, ["dense"])
    with pytest.raises(ValueError, match=r"\['feddf'\] not in the summary's results"):
        merge_methods(archived, run, ["feddf"])
    assert json.loads(archived.read_text()) == merged  # a refused merge writes nothing
    archived.write_text(json.dumps({**merged, "curves": {"ot": [[1, 61.5]]}}))  # a cell that keeps curves
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps({"method": "dense", "step": i, "accuracy": a})
                                 for i, a in ((1, 40.0), (2, 63.3))) + "\n")
    merge_methods(archived, run, ["dense"], metrics)
    assert json.loads(archived.read_text())["curves"] == {"ot": [[1, 61.5]], "dense": [[1, 40.0], [2, 63.3]]}
    assert "replaced" not in json.loads(archived.read_text())  # the same result again replaces nothing
    rerun = {**run, "results": {"dense": {**result, "accuracy": 70.0, "params": {"pool_shuffle": True}}}}
    metrics.write_text(json.dumps({"method": "dense", "step": 1, "accuracy": 70.0}) + "\n")
    merge_methods(archived, rerun, ["dense"], metrics)  # a re-run after a change of defaults
    merged = json.loads(archived.read_text())
    assert merged["results"]["dense"]["accuracy"] == 70.0 and merged["curves"]["dense"] == [[1, 70.0]]
    assert merged["replaced"] == {"dense": [{"result": {**result, "accuracy": 63.3}, "config": {"epochs": 200},
                                             "curve": [[1, 40.0], [2, 63.3]]}]}
    # a key set to its default is the config left out (a trial run with --set ...pool_shuffle=true
    # merges as the re-run at the new default); the cell keeps its config as written; another value is refused
    explicit = {"config": {**cfg, "methods": {"dense": {"epochs": 200, "pool_shuffle": True}}},
                "results": {"dense": {**result, "accuracy": 71.0}}}
    merge_methods(archived, explicit, ["dense"])
    merged = json.loads(archived.read_text())
    assert merged["results"]["dense"]["accuracy"] == 71.0 and merged["config"]["methods"]["dense"] == {"epochs": 200}
    off = {**explicit, "config": {**cfg, "methods": {"dense": {"epochs": 200, "pool_shuffle": False}}}}
    with pytest.raises(ValueError, match="dense ran with .*'pool_shuffle': False"):
        merge_methods(archived, off, ["dense"])
    # a run timed under another environment than the cell's carries it on its merged result; the same
    # run merged again replaces nothing
    elsewhere = {**explicit, "environment": {"cpu": "AMD EPYC", "threads": 1}}
    merge_methods(archived, elsewhere, ["dense"])
    merged = json.loads(archived.read_text())
    env = {"cpu": "AMD EPYC", "threads": 1}
    assert merged["results"]["dense"] == {**explicit["results"]["dense"], "environment": env}
    assert "environment" not in merged and len(merged["replaced"]["dense"]) == 3
    merge_methods(archived, elsewhere, ["dense"])
    assert json.loads(archived.read_text()) == merged


def test_merged_methods_count_in_the_cell_minutes_only_when_timed_on_the_cells_machine(tmp_path):
    from hetfl.reproduce.common import cell_minutes, merge_methods

    cfg = {"dataset": "fmnist", "seed": 0, "clients": 5, "partition": {"kind": "dirichlet", "alpha": 0.1},
           "client": {"model": "cnn2"}, "server": {"model": "cnn2"}, "methods": {"fedavg": {}}}
    here = {"device": "cpu", "cpu": "AMD EPYC", "cpu_capability": "AVX2", "threads": 1}
    result = {"accuracy": 40.0, "best_accuracy": 40.0, "uploads_sha256": "ab", "seconds": 0.1}
    archived = tmp_path / "cell.json"
    archived.write_text(json.dumps({"config": cfg, "results": {"fedavg": result}, "environment": here,
                                    "minutes": 20.0, "prior_minutes": 4.0}))
    run = {"config": {**cfg, "methods": {"dense": {}, "ot": {}}}, "environment": {**here, "threads": 2},
           "minutes": 60.0,  # the run's own clients' job included: not the merged methods' time
           "results": {"dense": {**result, "seconds": 1200.0}, "ot": {**result, "seconds": 6.0}}}
    merge_methods(archived, run, ["dense", "ot"])
    assert cell_minutes(json.loads(archived.read_text())) == pytest.approx(24.0 + 20.0 + 0.1)
    rerun = {**run, "results": {"dense": {**result, "accuracy": 41.0, "seconds": 1500.0}}}
    merge_methods(archived, rerun, ["dense"])  # a replaced result's time is in the cell already
    assert cell_minutes(json.loads(archived.read_text())) == pytest.approx(44.1)
    gpu = {**run, "environment": {"device": "cuda", "accelerator": "NVIDIA H200"},
           "results": {"coboosting": {**result, "seconds": 300.0}}}
    merge_methods(archived, gpu, ["coboosting"])  # timed on another machine: in its own result only
    merged = json.loads(archived.read_text())
    assert cell_minutes(merged) == pytest.approx(44.1) and merged["results"]["coboosting"]["seconds"] == 300.0


def test_archive_run_keeps_a_curve_and_merges_only_when_asked(tmp_path, capsys):
    from hetfl.cli import main
    from hetfl.reproduce.common import archive_run, cell_label

    assert cell_label("fedhydra-mnist-2cc-s0-paper", 0) == "mnist-2cc-s0"
    assert cell_label("fedhydra-mnist-0.01-s10-paper-bf16", 10) == "mnist-0.01-s10"  # a budget with a hyphen
    assert cell_label("fedmho-fmnist-a0.5-vgg9-e10-s1-reduced", 1) == "fmnist-a0.5-vgg9-e10-s1"
    for bad in ("mnist", "fedhydra-mnist-2cc-s1-paper", "s0-paper"):
        with pytest.raises(ValueError, match="not a cell name"):
            cell_label(bad, 0)
    cfg = {"name": "fedhydra-mnist-2cc-s0-paper", "dataset": "mnist", "seed": 0, "clients": 5,
           "partition": {"kind": "2c/c"}, "client": {"model": "cnn2"}, "server": {"model": "cnn2"},
           "methods": {"fedavg": {}}}
    result = {"accuracy": 27.0, "best_accuracy": 27.0, "uploads_sha256": "ab"}
    archive = tmp_path / "fedhydra-runs"
    (archive / "paper-server-curves").mkdir(parents=True)
    cell_file = archive / "fedhydra-mnist-2cc-s0-paper.json"
    cell_file.write_text(json.dumps({"config": cfg, "results": {"fedavg": result}}))
    manifest = archive / "paper-server-curves" / "runs.json"
    manifest.write_text(json.dumps({"about": "x", "runs": [{"cell": "mnist-2cc-s0, H200", "method": "dense",
                                                            "run": "old", "file": "old.jsonl"}]}))
    run = tmp_path / "run"
    run.mkdir()
    summary = {"config": {**cfg, "methods": {"fedhydra": {"epochs": 2}}},
               "results": {"fedhydra": {**result, "accuracy": 12.0}}}
    (run / "summary.json").write_text(json.dumps(summary))
    logged = [{"method": "fedhydra", "step": 1, "accuracy": 10.0}, {"method": "other", "step": 1, "accuracy": 1.0},
              {"method": "fedhydra", "step": 2, "accuracy": 12.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logged))

    entry = archive_run(archive, run, "fedhydra", "a trial", change="lr 0.005")  # a trial: not merged
    assert entry == {"cell": "mnist-2cc-s0, H200", "method": "fedhydra", "run": "a trial",
                     "file": "mnist-2cc-s0-fedhydra-cpu.jsonl", "change": "lr 0.005"}
    kept = (archive / "paper-server-curves" / entry["file"]).read_text().splitlines()
    assert [json.loads(line) for line in kept] == [logged[0], logged[2]]  # only that method's lines
    assert json.loads(manifest.read_text())["runs"][-1] == entry and len(json.loads(manifest.read_text())["runs"]) == 2
    assert "fedhydra" not in json.loads(cell_file.read_text())["results"]
    with pytest.raises(ValueError, match="exists; give another curve name"):
        archive_run(archive, run, "fedhydra", "again")

    assert main(["archive-run", "fedhydra", str(run), "--method", "fedhydra", "--label", "the budget's",
                 "--merge", "--curve", "m.jsonl", "--results", str(tmp_path / "fedhydra.md")]) == 0
    assert "merged into the archived cell" in capsys.readouterr().out
    merged = json.loads(cell_file.read_text())
    assert merged["results"]["fedhydra"]["accuracy"] == 12.0
    assert merged["config"]["methods"]["fedhydra"] == {"epochs": 2}
    assert "change" not in json.loads(manifest.read_text())["runs"][-1]

    before = (manifest.read_text(), cell_file.read_text())
    other = {**summary, "results": {"fedhydra": {**result, "uploads_sha256": "cd"}}}
    (run / "summary.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="did not run on fedhydra-mnist-2cc-s0-paper.json's uploads"):
        archive_run(archive, run, "fedhydra", "other uploads", curve="o.jsonl")
    with pytest.raises(ValueError, match=r"dense not in .*results \['fedhydra'\]"):
        archive_run(archive, run, "dense", "x", curve="o.jsonl")
    renamed = {**summary, "config": {**summary["config"], "name": "fedhydra-x-s0-paper"}}
    (run / "summary.json").write_text(json.dumps(renamed))
    with pytest.raises(ValueError, match="no archived cell named fedhydra-x-s0-paper"):
        archive_run(archive, run, "fedhydra", "x", curve="o.jsonl")
    (run / "summary.json").unlink()
    assert main(["archive-run", "fedhydra", str(run), "--method", "fedhydra", "--label", "x",
                 "--results", str(tmp_path / "fedhydra.md")]) == 2
    assert "summary.json and" in capsys.readouterr().err  # neither a summary nor a config
    (run / "config.json").write_text(json.dumps({**cfg, "seed": 1}))
    with pytest.raises(ValueError, match="a stopped run cannot be merged"):
        archive_run(archive, run, "fedhydra", "x", merge=True, curve="o.jsonl")
    with pytest.raises(ValueError, match="did not run on"):  # a stopped run of another setting
        archive_run(archive, run, "fedhydra", "x", curve="o.jsonl", change="c")
    assert (manifest.read_text(), cell_file.read_text()) == before  # refused archives write nothing
    assert not (archive / "paper-server-curves" / "o.jsonl").exists()
    (run / "config.json").write_text(json.dumps(cfg))  # stopped on the cell's setting: its curve is kept
    (run / "fedhydra").mkdir()
    (run / "metrics.jsonl").rename(run / "fedhydra" / "metrics.jsonl")  # as a stopped run has it
    assert archive_run(archive, run, "fedhydra", "stopped", curve="o.jsonl")["file"] == "o.jsonl"
    assert json.loads(cell_file.read_text()) == json.loads(before[1])
    assert len((archive / "paper-server-curves" / "o.jsonl").read_text().splitlines()) == 2
    # the same run, resumed and longer: its curve replaces the stopped one (file and runs.json entry)
    log = run / "fedhydra" / "metrics.jsonl"
    log.write_text(log.read_text() + json.dumps({"method": "fedhydra", "step": 9, "accuracy": 50.0}) + "\n")
    longer = archive_run(archive, run, "fedhydra", "resumed", curve="q.jsonl")
    assert longer["replaces"] == "o.jsonl" and not (archive / "paper-server-curves" / "o.jsonl").exists()
    listed = json.loads(manifest.read_text())["runs"]
    assert [r["file"] for r in listed if r["file"] in ("o.jsonl", "q.jsonl")] == ["q.jsonl"]
    assert len((archive / "paper-server-curves" / "q.jsonl").read_text().splitlines()) == 3
    # a finished device trial as scripts/device-trials.sh brings it back: <name>.summary.json and <name>.jsonl
    out = tmp_path / "out"
    out.mkdir()
    (out / "both.summary.json").write_text(json.dumps(summary))
    trial_log = [{**r, "accuracy": r["accuracy"] + 1} for r in logged]  # its own curve: no earlier one begins it
    (out / "both.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trial_log))
    trial = archive_run(archive, out / "both.summary.json", "fedhydra", "a device trial", change="c", curve="t.jsonl")
    assert trial == {"cell": "mnist-2cc-s0, H200", "method": "fedhydra", "run": "a device trial", "file": "t.jsonl",
                     "change": "c"}
    assert [json.loads(line) for line in (archive / "paper-server-curves" / "t.jsonl").read_text().splitlines()] \
        == [trial_log[0], trial_log[2]]
    (out / "both.jsonl").unlink()
    with pytest.raises(ValueError, match="a device trial needs both"):
        archive_run(archive, out / "both.summary.json", "fedhydra", "x", curve="u.jsonl")
    # a twin: another listed curve of the same method and cell, else refused before anything is written
    (out / "both.jsonl").write_text("".join(json.dumps({**r, "accuracy": r["accuracy"] + 2}) + "\n" for r in logged))
    with pytest.raises(ValueError, match="not a curve listed"):  # old.jsonl is listed but its file is missing
        archive_run(archive, out / "both.summary.json", "fedhydra", "x", curve="w.jsonl", twin="old.jsonl")
    (archive / "paper-server-curves" / "old.jsonl").write_text(json.dumps(logged[0]) + "\n")
    for twin, match in (("none.jsonl", "not a curve listed"),
                        ("old.jsonl", "is dense of mnist-2cc-s0, H200, not fedhydra of mnist-2cc-s0")):
        with pytest.raises(ValueError, match=match):
            archive_run(archive, out / "both.summary.json", "fedhydra", "x", curve="w.jsonl", twin=twin)
    assert not (archive / "paper-server-curves" / "w.jsonl").exists()
    assert main(["archive-run", "fedhydra", str(out / "both.summary.json"), "--method", "fedhydra", "--label",
                 "a probe", "--curve", "w.jsonl", "--twin", "t.jsonl", "--results", str(tmp_path / "fedhydra.md")]) == 0
    assert json.loads(manifest.read_text())["runs"][-1] == {"cell": "mnist-2cc-s0, H200", "method": "fedhydra",
                                                            "run": "a probe", "file": "w.jsonl", "twin": "t.jsonl"}
    no_eval = json.dumps({"method": "fedhydra", "step": 1, "kd_loss": 1.0}) + "\n"
    (run / "fedhydra" / "metrics.jsonl").write_text(no_eval)
    with pytest.raises(ValueError, match="no evaluated epoch of fedhydra"):  # a log without an evaluation
        archive_run(archive, run, "fedhydra", "x", curve="p.jsonl")


def test_shipped_vgg9_trial_config_is_the_reproduce_cell():
    """configs/fedmho-fmnist-vgg9-e10.yaml must send the reproduce cell's requests (same upload cache):
    every key but the method subset equals ``cell_config``'s, and each of its methods has the cell's params."""
    import yaml

    from hetfl.reproduce import fedmho as mho

    shipped = yaml.safe_load((Path(__file__).parents[1] / "configs" / "fedmho-fmnist-vgg9-e10.yaml").read_text())
    cell = mho.cell_config("fmnist", "0.5", 0, "vgg9-e10")
    assert {k: v for k, v in shipped.items() if k != "methods"} == {k: v for k, v in cell.items() if k != "methods"}
    assert shipped["methods"] and all(cell["methods"][m] == p for m, p in shipped["methods"].items())


def test_a_resumed_cell_starts_all_its_missing_methods_at_once(tmp_path, tiny_config):
    """A second device call finds the cell's summary (ensemble and FedAvg done) and its long methods
    half-way: an uploads-only job (from the cache: nothing retrained), then every missing method side
    by side; not the first method alone with the others (and their checkpoints) waiting for it."""
    from hetfl.reproduce.common import _plan, run_cells_parallel

    gen = {"epochs": 1, "generator_steps": 1, "batch_size": 8}
    cheap = {**tiny_config, "device": "cpu", "methods": {"ensemble": {}, "fedavg": {}}}
    cache = tmp_path / "cache"
    assert run_cells_parallel([cheap], tmp_path / "r", cache, None, jobs=3, threads=1, say=lambda _: None) == []
    full = validate({**cheap, "methods": {**cheap["methods"], "dense": gen, "coboosting": gen}})
    plan = _plan([full], tmp_path / "r")
    assert [(j.methods, j.clients, sorted(j.warm)) for j in plan.ready] == [([], [0, 1, 2], ["coboosting", "dense"])]
    assert [j.methods for j in plan.later["tiny"]] == [["dense"], ["coboosting"]]
    assert len(_plan([full], tmp_path / "r", client_jobs=3).ready) == 3  # one shard per client
    fresh = _plan([validate({**cheap, "methods": {"dense": gen, "coboosting": gen}})], tmp_path / "new")
    # a cell with no summary and no cheap method: its clients' job runs (and writes) the first method
    assert [(j.methods, j.clients, j.warm) for j in fresh.ready] == [(["dense"], None, ["coboosting"])]
    lines: list[str] = []
    assert run_cells_parallel([full], tmp_path / "r", cache, None, jobs=3, threads=1, say=lines.append) == []
    started = [line for line in lines if line.endswith("started")]
    assert started == ["tiny: clients 0,1,2 started", "tiny: dense started", "tiny: coboosting started"]
    assert lines.index("tiny: coboosting started") < min(i for i, x in enumerate(lines) if "dense done" in x)
    res = json.loads((tmp_path / "r" / "tiny" / "summary.json").read_text())["results"]
    assert set(res) == {"ensemble", "fedavg", "dense", "coboosting"}
    assert res["dense"]["cached_uploads"] == res["coboosting"]["cached_uploads"] == 3
    assert res["dense"]["uploads_sha256"] == res["fedavg"]["uploads_sha256"]


def test_client_shards_minutes_count_in_the_cells_minutes(tmp_path, tiny_config):
    """The shards write no summary: their wall minutes go into the cell's (after the clients' job, or
    at once in a resumed cell), so a cell's minutes count every process that worked on it."""
    from hetfl.reproduce.common import _advance, _plan, cell_minutes

    gen = {"epochs": 1, "generator_steps": 1, "batch_size": 8}
    cfg = validate({**tiny_config, "device": "cpu", "methods": {"ensemble": {}, "fedavg": {}, "dense": gen}})
    cell = tmp_path / "tiny"
    cell.mkdir()
    done = {**cfg, "methods": {"ensemble": {}, "fedavg": {}}}
    (cell / "summary.json").write_text(json.dumps({"config": done, "minutes": 1.0, "results": {
        m: {"accuracy": 10.0, "best_accuracy": 10.0} for m in ("ensemble", "fedavg")}}))
    plan = _plan([cfg], tmp_path, client_jobs=2)
    assert [j.clients for j in plan.ready] == [[0, 2], [1]] and not plan.held
    for job, ago in zip(list(plan.ready), (90.0, 30.0)):
        plan.ready.remove(job)
        job.start = time.perf_counter() - ago
        _advance(plan, job, True, tmp_path, {"tiny": cfg})
    assert [j.methods for j in plan.ready] == [["dense"]]  # after the last shard
    assert cell_minutes(json.loads((cell / "summary.json").read_text())) == pytest.approx(3.0, abs=0.01)


def test_curve_legend_labels_wrap_at_their_width():
    row = {"method": "dense", "run": "stopped by the session's end after 70 of 200 epochs on a 2-vCPU Xeon "
                                    "with AMX (fifty-seventh session), fp32, one thread beside another run"}
    label = paper._run_label(row)
    assert label.startswith("DENSE, stopped") and label.replace("\n", " ") == f"DENSE, {row['run']}"
    assert label.count("\n") == 1 and all(len(line) <= 100 for line in label.splitlines())
    assert "\n" not in paper._run_label({"method": "dense", "run": "200 epochs (H200)"})


def test_a_later_one_cache_grid_has_its_own_section_and_standing_columns_and_older_ours_is_marked(tmp_path):
    archive = tmp_path / "fedhydra-runs"
    first, later = archive / paper.ONE_CACHE, archive / f"{paper.LATER_GRID}amd"
    assert paper.one_cache_grids(archive) == []
    cfg = paper.cell_config("mnist", "0.1", 0, "reduced")
    env = {"device": "cpu", "cpu": "AMD EPYC", "cpu_capability": "AVX512", "threads": 1}
    for folder, ours in ((first, {"accuracy": 59.0, "best_accuracy": 60.0}),  # pool order: no params
                         (later, shuffled(paper.VARIANT, {"accuracy": 69.0, "best_accuracy": 70.0}))):
        folder.mkdir(parents=True)
        results = {"fedavg": {"accuracy": 40.0, "best_accuracy": 40.0}, paper.VARIANT: ours}
        (folder / f"{cfg['name']}.json").write_text(json.dumps({"config": cfg, "results": results,
                                                                "environment": env}))
    (archive / "one-cache-notes.md").write_text("a file, not a grid")
    assert paper.one_cache_grids(archive) == [("", first), ("amd", later)]
    rows = paper.standing(first, grids=paper.one_cache_grids(archive))
    assert list(rows["mnist", "0.1"]["budgets"]) == ["reduced", "reduced@amd"]
    lines = paper.standing_table(rows).splitlines()
    assert "| `reduced` best baseline | `reduced`, grid `amd` ours | `reduced`, grid `amd` best baseline |" in next(
        x for x in lines if x.startswith("| dataset |"))
    assert next(x for x in lines if x.startswith("| MNIST | α=0.1 |")) == (
        "| MNIST | α=0.1 | 59.97 | - | **60.00 n=1 †** | 40.00 FedAvg | **70.00 n=1** | 40.00 FedAvg | "
        "+10.03 (`reduced`, grid `amd`) |")
    assert lines[-1].startswith("† Ours (FedHydra in DENSE's loop, log1p(U)) with the KD batches in pool order")
    out = tmp_path / "fedhydra.md"
    paper.write_results(tmp_path / "runs", out)
    text = out.read_text()
    first_section, later_section = text.split("## All methods on one upload cache (budget `reduced`")[1:3]
    assert later_section.startswith(", grid `amd`)") and "Ran on: cpu (AMD EPYC, AVX512), 1 thread." in later_section
    assert "70.00 (69.00) n=1 |" in later_section and "60.00 (59.00) n=1 † |" in first_section
    assert "Ran on" not in first_section
    assert paper.one_cache_figure_path(out, "mnist", "reduced", "amd").name == \
        "fedhydra-one-cache-amd-curves-mnist-reduced.png"


def test_results_of_older_defaults_are_marked_in_the_tables():
    """Co-Boosting's results from before its gradient clips (no ``params``, or params without them)
    are marked † in the report's tables, with one footnote; results since are not."""
    from hetfl.reproduce import common
    from hetfl.reproduce import fedhydra as paper

    old, new = {"accuracy": 30.0, "best_accuracy": 40.0}, {"accuracy": 31.0, "best_accuracy": 41.0,
                                                           "params": {"grad_clip": 10.0, "generator_grad_clip": 10.0,
                                                                      "pool_shuffle": True}}
    off = {**new, "params": {"grad_clip": 0.0, "generator_grad_clip": 10.0}}
    assert common.older_defaults("coboosting", old) and common.older_defaults("coboosting", off)
    assert not common.older_defaults("coboosting", new) and not common.older_defaults("fedavg", old)
    # DENSE, FedHydra in DENSE's loop and ours: the KD batches reshuffled each epoch since the 66th session
    for method in ("dense", "fedhydra_dense", "fedhydra_dense_log1p"):
        assert common.older_defaults(method, old)  # no params: before the change
        assert common.older_defaults(method, {**old, "params": {"pool_shuffle": False}})
        assert not common.older_defaults(method, {**old, "params": {"pool_shuffle": True, "epochs": 20}})
    assert common.older_defaults("coboosting", {**new, "params": {**new["params"], "pool_shuffle": False}})
    assert common.older_mark("coboosting", [old, old]) == " †"
    assert common.older_mark("coboosting", [old, new]) == " † 1 of 2" and common.older_mark("coboosting", [new]) == ""

    def cell(setting: str, seed: int, co: dict) -> dict:
        part = {"kind": "2c/c"} if setting == "2c/c" else {"kind": "dirichlet", "alpha": float(setting), "min_size": 10}
        return {"config": {"dataset": "mnist", "clients": 5, "seed": seed, "partition": part, "methods": {}},
                "results": {"dense": shuffled("dense", {"accuracy": 20.0, "best_accuracy": 25.0}), "coboosting": co}}

    lines = paper._table([cell("0.5", 0, old), cell("0.5", 1, new), cell("2c/c", 0, new)], "mnist",
                         ("dense", "coboosting"))
    co_row = next(x for x in lines if x.startswith("| Co-Boosting"))
    assert "n=2 † 1 of 2" in co_row and co_row.count("†") == 1  # 2c/c: the clipped run only
    assert "†" not in next(x for x in lines if x.startswith("| DENSE"))
    assert lines[-1].startswith("† Co-Boosting without its code's gradient clipping")
    assert not any("†" in x for x in paper._table([cell("0.5", 0, new)], "mnist", ("dense", "coboosting")))


def test_replaced_report_sets_a_merged_rerun_beside_the_result_it_replaced(tmp_path):
    from hetfl.reproduce.common import merge_methods, replaced_report, replaced_rows

    assert replaced_report(tmp_path, {}, ("reduced",)) == ""
    folder = tmp_path / "one-cache"
    folder.mkdir()
    new_params = {"grad_clip": 10.0, "generator_grad_clip": 10.0, "pool_shuffle": True}
    runs = (("2cc", 1, 50.0, 48.0), ("2cc", 0, 40.0, 45.0), ("0.5", 0, 70.0, 80.0))  # (setting, seed, old, new)
    for setting, seed, old, new in runs:
        cfg = {"name": f"fedhydra-mnist-{setting}-s{seed}-reduced-t60", "dataset": "mnist", "seed": seed,
               "clients": 5, "partition": {"kind": setting}, "client": {"model": "cnn2"},
               "server": {"model": "cnn2"}, "methods": {"fedavg": {}, "coboosting": {"epochs": 60}}}
        digest = {"uploads_sha256": f"d{seed}{setting}"}
        cell = {"config": cfg, "results": {"fedavg": {"accuracy": 20.0, **digest},
                                           "ours": {"accuracy": 60.0, "best_accuracy": 61.0 + seed, **digest},
                                           "coboosting": {"accuracy": old - 1, "best_accuracy": old, **digest}}}
        (folder / f"{cfg['name']}.json").write_text(json.dumps(cell))
        rerun = {"config": cfg, "results": {"coboosting": {"accuracy": new - 2, "best_accuracy": new,
                                                           "params": new_params, **digest}}}
        merge_methods(folder / f"{cfg['name']}.json", rerun, ["coboosting"])
    (folder / "partial").mkdir()  # a summary kept apart is not read
    (folder / "partial" / "x.json").write_text(json.dumps({**cell, "replaced": {"coboosting": []}}))
    rows = replaced_rows(tmp_path)
    assert sorted((r["setting"], r["seed"], r["before"]["best_accuracy"], r["after"]["best_accuracy"], r["older"])
                  for r in rows) == [("mnist-0.5", 0, 70.0, 80.0, True), ("mnist-2cc", 0, 40.0, 45.0, True),
                                     ("mnist-2cc", 1, 50.0, 48.0, True)]
    text = replaced_report(tmp_path, {"coboosting": "Co-Boosting", "ours": "Ours"}, ("reduced", "reduced-t60"),
                           against="ours")
    table = [line for line in text.splitlines() if line.startswith("| `")]
    assert table == [
        "| `reduced-t60` | fedhydra-mnist-0.5-s0-reduced-t60 | Co-Boosting | 70.00 (69.00) † | 80.00 (78.00) | "
        "+10.00 | +9.00 | 61.00 |",
        "| `reduced-t60` | fedhydra-mnist-2cc-s0-reduced-t60 | Co-Boosting | 40.00 (39.00) † | 45.00 (43.00) | "
        "+5.00 | +4.00 | 61.00 |",
        "| `reduced-t60` | fedhydra-mnist-2cc-s1-reduced-t60 | Co-Boosting | 50.00 (49.00) † | 48.00 (46.00) | "
        "-2.00 | -3.00 | 62.00 |",
        "| `reduced-t60` | **mnist-2cc, mean of 2** (best higher in 1) | Co-Boosting | 45.00 | 46.50 | **+1.50** | "
        "**+0.50** | 61.50 n=2 |",
        "| `reduced-t60` | **all, mean of 3** (best higher in 2) | Co-Boosting | 53.33 | 57.67 | **+4.33** | "
        "**+3.33** | 61.33 n=3 |"]
    assert "| Ours, best |" in text and "### Per cell and method" in text and "\n† Co-Boosting without" in text


def test_archive_merge_command_merges_a_rerun_cell_and_refuses_other_uploads(tmp_path, capsys):
    from hetfl.cli import main

    folder = tmp_path / "fedhydra-runs" / "one-cache"
    folder.mkdir(parents=True)
    cfg = {"name": "fedhydra-fmnist-0.5-s0-reduced", "dataset": "fmnist", "seed": 0, "clients": 5,
           "partition": {"kind": "dirichlet", "alpha": 0.5}, "client": {"model": "cnn2"},
           "server": {"model": "cnn2"}, "methods": {"fedavg": {}, "coboosting": {"epochs": 20}}}
    cell = {"config": cfg, "results": {"fedavg": {"accuracy": 60.0}, "ensemble": {"accuracy": 62.0},
                                       "coboosting": {"accuracy": 55.0, "best_accuracy": 58.0}},
            "curves": {"coboosting": [[1, 58.0], [2, 55.0]]}}
    (folder / f"{cfg['name']}.json").write_text(json.dumps(cell))
    run = tmp_path / "runs" / cfg["name"]
    run.mkdir(parents=True)
    rerun = {"config": cfg, "results": {"fedavg": {"accuracy": 60.0}, "ensemble": {"accuracy": 62.0},
                                        "coboosting": {"accuracy": 66.0, "best_accuracy": 67.0}}}
    (run / "summary.json").write_text(json.dumps(rerun))
    (run / "metrics.jsonl").write_text(json.dumps({"method": "coboosting", "step": 1, "accuracy": 67.0}) + "\n")
    results = tmp_path / "fedhydra.md"
    assert main(["archive-merge", "fedhydra", str(run), "--methods", "coboosting", "--results", str(results)]) == 0
    assert "merged coboosting of" in capsys.readouterr().out
    merged = json.loads((folder / f"{cfg['name']}.json").read_text())
    assert merged["results"]["coboosting"]["accuracy"] == 66.0 and merged["curves"]["coboosting"] == [[1, 67.0]]
    assert merged["replaced"]["coboosting"][0]["result"]["accuracy"] == 55.0
    other = {**rerun, "results": {**rerun["results"], "fedavg": {"accuracy": 60.01}}}  # other uploads
    (run / "summary.json").write_text(json.dumps(other))
    assert main(["archive-merge", "fedhydra", str(run), "--methods", "coboosting", "--results", str(results)]) == 2
    assert "did not run on the archived cell's uploads" in capsys.readouterr().err
    assert json.loads((folder / f"{cfg['name']}.json").read_text()) == merged  # refused: nothing written
    assert main(["archive-merge", "fedhydra", str(tmp_path / "none"), "--methods", "coboosting",
                 "--results", str(results)]) == 2
    assert "summary.json: missing" in capsys.readouterr().err


def test_archive_replace_command_swaps_whole_cells_and_names_refusals(tmp_path, capsys):
    from hetfl.cli import main

    archive = tmp_path / "fedmho-runs"
    archive.mkdir()
    cfg = {"name": "fedmho-mnist-a0.1-s0-reduced", "dataset": "mnist", "seed": 0, "clients": 10,
           "partition": {"kind": "dirichlet", "alpha": 0.1}, "methods": {"fedavg": {}, "fedmho": {}}}
    results = {"fedavg": {"accuracy": 40.0}, "fedmho": {"accuracy": 80.0}}
    (archive / f"{cfg['name']}.json").write_text(json.dumps({"config": cfg, "results": results}))
    run = tmp_path / "runs" / cfg["name"]
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"config": cfg, "results": {"fedavg": {"accuracy": 41.0}}}))
    args = ["archive-replace", "fedmho", str(run), "--kept-as", "before", "--results", str(tmp_path / "fedmho.md")]
    assert main(args) == 2
    assert "lacks ['fedmho']" in capsys.readouterr().err
    (run / "summary.json").write_text(json.dumps({"config": cfg, "results": {**results, "fedavg": {"accuracy": 41.0}}}))
    assert main(args) == 0
    assert "the earlier copy kept as" in capsys.readouterr().out
    assert json.loads((archive / f"{cfg['name']}.json").read_text())["results"]["fedavg"]["accuracy"] == 41.0
    assert json.loads((archive / "partial" / "before" / f"{cfg['name']}.json").read_text())["results"] == results
    # fedhydra's sweep cells are in one-cache/: --folder names it; the earlier copy goes to the archive's partial/
    hydra = tmp_path / "fedhydra-runs" / "one-cache"
    hydra.mkdir(parents=True)
    (hydra / f"{cfg['name']}.json").write_text(json.dumps({"config": cfg, "results": results}))
    assert main(["archive-replace", "fedhydra", str(run), "--kept-as", "before", "--folder", "one-cache",
                 "--results", str(tmp_path / "fedhydra.md")]) == 0
    assert json.loads((hydra / f"{cfg['name']}.json").read_text())["results"]["fedavg"]["accuracy"] == 41.0
    assert (tmp_path / "fedhydra-runs" / "partial" / "before" / f"{cfg['name']}.json").is_file()


def test_retrain_mismatch_names_the_recorded_differences_and_ignores_unrecorded_ones():
    from hetfl.reproduce.common import retrain_mismatch

    here = {"device": "cpu", "cpu": "Intel(R) Xeon(R) Processor", "torch": "2.13.0+cpu", "threads": 2}
    assert retrain_mismatch({**here, "python": "3.10"}, here) is None  # other keys do not matter
    assert retrain_mismatch({"device": "cpu", "threads": 2}, here) is None  # no cpu recorded: cannot tell
    assert retrain_mismatch({**here, "cpu": "AMD EPYC"}, here) == "cpu 'AMD EPYC' here 'Intel(R) Xeon(R) Processor'"
    both = retrain_mismatch({**here, "threads": 1, "torch": "2.12.0"}, here)
    assert both == "torch '2.12.0' here '2.13.0+cpu'; threads 1 here 2"
    avx = {**here, "cpu": "AMD EPYC", "cpu_capability": "AVX512"}  # one name, two instruction sets
    assert retrain_mismatch({**avx, "cpu_capability": "AVX2"}, avx) == "cpu_capability 'AVX2' here 'AVX512'"


def test_unrecorded_lists_the_retrain_keys_an_archived_environment_lacks():
    from hetfl.reproduce.common import RETRAIN_KEYS, unrecorded

    assert unrecorded({k: "x" for k in RETRAIN_KEYS}) == []
    assert unrecorded({"device": "cpu", "threads": 2, "torch": "2.13.0+cpu", "cpu": None}) == ["cpu", "cpu_capability"]
    assert unrecorded({}) == list(RETRAIN_KEYS)


def test_archive_check_command_exits_1_on_another_processor_and_2_on_an_unknown_cell(tmp_path, capsys):
    import torch

    from hetfl.cli import main
    from hetfl.engine.simulator import run_environment

    folder = tmp_path / "fedhydra-runs" / "one-cache"
    folder.mkdir(parents=True)
    here = run_environment(torch.device("cpu"))  # what a CPU run's summary records
    (folder / "same.json").write_text(json.dumps({"environment": here}))
    (folder / "old.json").write_text(json.dumps({"environment": {"threads": here["threads"]}}))
    (folder / "amd.json").write_text(json.dumps({"environment": {**here, "cpu": "some other CPU"}}))
    results = ["--results", str(tmp_path / "fedhydra.md")]
    assert main(["archive-check", "fedhydra", "same", "old", *results]) == 0
    assert capsys.readouterr().out == (
        "same: same processor, instruction set, torch and threads\nold: no recorded difference, but device, cpu, "
        "cpu_capability, torch not "
        "recorded: only the merge's upload check, after the run, can tell\n")
    assert main(["archive-check", "fedhydra", "same", "amd", *results]) == 1
    assert "amd: other uploads here (cpu 'some other CPU' here " in capsys.readouterr().out
    assert main(["archive-check", "fedhydra", "none", *results]) == 2
    assert "no archived cell named none" in capsys.readouterr().err


def test_the_paper_modules_import_without_torch():
    """The CLI imports both to build its help; torch, the methods and the simulator load only when a run needs them."""
    code = ("import sys, pathlib, hetfl.reproduce.fedhydra, hetfl.reproduce.fedmho, hetfl.reproduce.common; "
            "hetfl.reproduce.fedmho.probe_lines(pathlib.Path('none.json')); "  # the report's probe table too
            "sys.exit(int('torch' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_fedmho_filter_probe_without_a_matching_cell_says_so(tmp_path, capsys):
    from hetfl.cli import main

    assert main(["reproduce", "fedmho", "--filter-probe", "--out", str(tmp_path / "runs"), "--results",
                 str(tmp_path / "fedmho.md"), "--settings", "0.3", "--seeds", "1"]) == 2
    assert "no Table 4 cell of budget 'reduced' matches --datasets mnist,fmnist --settings 0.3 --seeds 1" in \
        capsys.readouterr().err
    assert not (tmp_path / "fedmho-runs").exists()
