"""lm-evaluation-harness against a router: the plan of runs, run by tests/clients/lm_eval_run.py in
the clients venv, and what each run scored and answered."""

from __future__ import annotations

import json
import pathlib

from services.common.tokenizer import BUILTIN_MODEL_DIR
from tests.clients.clients_venv import CLIENTS_BIN, run_client
from tests.integration.mesh import Proc

HERE = pathlib.Path(__file__).resolve().parent
TASKS_DIR = HERE / "tasks"
MODEL = "pdmesh-tiny"


def completions_run(router: Proc, tasks: list[str], batch_size: int) -> dict:
    """local-completions with the checkpoint's own tokenizer (prompts go out as token ids)."""
    args = (f"model={MODEL},base_url={router.http_url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={BUILTIN_MODEL_DIR},max_retries=1")
    return {"model": "local-completions", "model_args": args, "tasks": tasks, "batch_size": batch_size}


def chat_run(router: Proc, tasks: list[str]) -> dict:
    """local-chat-completions: lm-eval sends the messages, the router applies the chat template."""
    args = f"model={MODEL},base_url={router.http_url}/v1/chat/completions,max_retries=1"
    return {"model": "local-chat-completions", "model_args": args, "tasks": tasks, "apply_chat_template": True}


# the built-in model's end-of-turn text: lm-eval's Anthropic client adds it to every request's stop
# sequences, and needs it named (it has no tokenizer to read it from)
MESSAGES_EOS = "<|end|>"


def messages_run(router: Proc, tasks: list[str]) -> dict:
    """anthropic-chat-completions: lm-eval's own HTTP client for Anthropic's Messages API (key from
    ANTHROPIC_API_KEY, sent as x-api-key), pointed at the router's /v1/messages."""
    args = f"model={MODEL},base_url={router.http_url}/v1/messages,eos_string={MESSAGES_EOS},max_retries=1"
    return {"model": "anthropic-chat-completions", "model_args": args, "tasks": tasks, "apply_chat_template": True}


def messages_stops(until: list[str]) -> list[str]:
    """The stop sequences lm-eval's Anthropic client sends for a task's `until`: its eos string
    added, whitespace-only ones dropped (Anthropic's API refuses them)."""
    return [s for s in [*until, MESSAGES_EOS] if s.strip()]


def run_lm_eval(plan: list[dict], tmp: pathlib.Path, timeout: float = 240) -> list[dict]:
    plan_path, out_path = tmp / "lm_eval_plan.json", tmp / "lm_eval_out.json"
    plan_path.write_text(json.dumps(plan))
    # the task configs name their data files relative to the tasks folder; everything is local
    run_client([str(CLIENTS_BIN / "python"), str(HERE / "lm_eval_run.py"), str(plan_path), str(out_path)], tmp,
               timeout=timeout, cwd=TASKS_DIR, env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                                                   "ANTHROPIC_API_KEY": "unused"})
    return json.loads(out_path.read_text())


def task_docs(task: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS_DIR / f"{task}.jsonl").read_text().splitlines() if line.strip()]
