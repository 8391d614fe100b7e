"""Run lm-evaluation-harness (its Python API, in the clients venv) and write what it scored.

Run by tests/clients/test_lm_eval_*.py as `.venv-clients/bin/python tests/clients/lm_eval_run.py
PLAN OUT`: PLAN is a JSON list of runs ({"model", "model_args", "tasks", "batch_size",
"apply_chat_template"}), OUT gets one {"results", "samples"} per run. Every run goes through
lm-eval's own model classes (`local-completions`, `local-chat-completions`) and task loader, as
`lm_eval --model ...` does. Why not the `lm_eval` command: it indexes the ~14,000 bundled task
configs before it starts (two CPU minutes on a loaded two-core machine); the API lets the
TaskManager load only tests/clients/tasks, and one process serves every run of a test.
"""

from __future__ import annotations

import json
import pathlib
import sys

from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

TASKS_DIR = pathlib.Path(__file__).resolve().parent / "tasks"


def main(plan_path: str, out_path: str) -> None:
    plan = json.loads(pathlib.Path(plan_path).read_text())
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    outputs = []
    for run in plan:
        result = simple_evaluate(
            model=run["model"], model_args=run["model_args"], tasks=run["tasks"],
            batch_size=run.get("batch_size", 1), apply_chat_template=run.get("apply_chat_template", False),
            task_manager=manager, log_samples=True, bootstrap_iters=0,
        )
        outputs.append({"results": result["results"], "samples": result["samples"]})
    # default=str: a sample's arguments hold tuples and lm-eval's JsonChatStr, kept as text
    pathlib.Path(out_path).write_text(json.dumps(outputs, default=str))


if __name__ == "__main__":
    main(*sys.argv[1:])
