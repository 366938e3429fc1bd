"""One job of a parallel reproduction, in its own process: ``python -m hetfl.reproduce.worker JOB.json``.

The job file names a cell config (restricted to the methods to run), an output folder, the upload
cache, the data root and the torch thread count, and optionally ``warm``: the other methods of the
cell (with their parameters), whose client uploads the worker trains into the cache first, so that
the workers started after it all read the same uploads. The worker then runs the missing methods
there and stamps its wall-clock minutes into ``summary.json``. A job with ``clients`` (a shard of
the cell's clients) only trains the ``warm`` methods' uploads of those clients into the cache. See
:func:`hetfl.reproduce.common.run_cells_parallel`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

INTERRUPTED = 130  # the exit status of a worker that Ctrl-C or SIGINT stopped (a shell's 128 + 2)


def main(argv: list[str] | None = None) -> int:
    job = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    import torch

    from hetfl.host import flush_denormals, keep_freed_memory
    from hetfl.reproduce.common import run_missing_methods

    keep_freed_memory()
    if job["config"].get("simulator", {}).get("flush_denormal"):
        flush_denormals()  # before torch's worker threads start (hetfl.host)
    torch.set_num_threads(int(job["threads"]))
    out = Path(job["out"])
    start = time.perf_counter()
    if job.get("clients") is not None:  # one shard of a cell's clients: uploads only
        return train_shard(job, out, start)
    try:
        summary = run_missing_methods(job["config"], out, Path(job["cache"]) if job["cache"] else None,
                                      job["data_root"], bool(job["quiet"]), warm=job.get("warm"))
    except KeyboardInterrupt:
        print("worker: interrupted (checkpoints written so far are kept)", file=sys.stderr)
        return INTERRUPTED
    if "minutes" not in summary:  # a summary returned unchanged (nothing left to run) keeps its minutes
        summary["minutes"] = (time.perf_counter() - start) / 60
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


def train_shard(job: dict, out: Path, start: float) -> int:
    """Train the uploads of the job's ``warm`` methods for its ``clients`` into the cache; print the
    accepted uploads per method and the minutes (the job's log keeps them)."""
    from hetfl.reproduce.common import train_upload_shard

    out.mkdir(parents=True, exist_ok=True)
    try:
        counts = train_upload_shard(job["config"], out, Path(job["cache"]), job["data_root"], bool(job["quiet"]),
                                    job["warm"], job["clients"])
    except KeyboardInterrupt:
        print("worker: interrupted (uploads cached so far and the last local training checkpoint kept)",
              file=sys.stderr)
        return INTERRUPTED
    print(f"shard: clients {job['clients']}, uploads {counts}, {(time.perf_counter() - start) / 60:.2f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
