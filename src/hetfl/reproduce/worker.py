"""One job of a parallel reproduction, in its own process: ``python -m hetfl.reproduce.worker JOB.json``.

The job file names a cell config (restricted to the methods to run), an output folder, the upload
cache, the data root and the torch thread count, and optionally ``warm``: the other methods of the
cell (with their parameters), whose client uploads the worker trains into the cache first, so that
the workers started after it all read the same uploads. The worker then runs the missing methods
there and stamps its wall-clock minutes into ``summary.json``. See :func:`hetfl.reproduce.common.run_cells_parallel`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    job = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    import torch

    from hetfl.host import keep_freed_memory
    from hetfl.reproduce.common import run_missing_methods

    keep_freed_memory()
    torch.set_num_threads(int(job["threads"]))
    out = Path(job["out"])
    start = time.perf_counter()
    try:
        summary = run_missing_methods(job["config"], out, Path(job["cache"]) if job["cache"] else None,
                                      job["data_root"], bool(job["quiet"]), warm=job.get("warm"))
    except KeyboardInterrupt:
        print("worker: interrupted (checkpoints written so far are kept)", file=sys.stderr)
        return 130
    if "minutes" not in summary:  # a summary returned unchanged (nothing left to run) keeps its minutes
        summary["minutes"] = (time.perf_counter() - start) / 60
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
