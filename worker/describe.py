"""``python -m worker.describe MODULE...``: print the catalog of task modules.

Run by the API at start and by ``gpulane catalog`` (never imported by them: the
dispatcher loads no task code), so the types a deployment is configured to run are
known before any worker has started. CUDA is hidden before the task modules load: a
module that touches a GPU at import finds none, and no card is held. The last line of
stdout is the JSON object ``{type: {"schema", "description", "file"}}``.
"""

from __future__ import annotations

import json
import os
import sys

__all__ = ["main"]


def main(modules: list[str]) -> int:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from worker.registry import REGISTRY, TaskModuleError, load_task_modules

    try:
        load_task_modules(modules)
    except TaskModuleError as exc:  # any import error: say which module, no traceback
        print(f"cannot load task modules: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write("\n" + json.dumps(REGISTRY.catalog(), separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
