"""`make gpu-check`: pdmesh on CUDA GPUs in under 5 minutes, one JSON file of results.

Checks, in order (each is recorded, pass or fail, and a failure does not stop the later ones):

  packages     every module pdmesh needs imports; otherwise it prints the pip command (versions
               from requirements*.txt; nixl-cu13 for a CUDA 13 torch, nixl-cu12 for CUDA 12)
               and stops. --install runs that command (--wheelhouse DIR: offline, from wheels
               carried to the machine)
  logits       the engine against transformers on cuda:0, tiny random Llama and Qwen2
               checkpoints, both in bfloat16: every chunk-end and the decode step's logits within
               max|Δ| <= 0.05 + 0.02·max|ref| (a few bf16 steps at the logits' scale); max|Δ|
               against transformers in float32 is reported too
  mesh         prefill on cuda:0 and decode on cuda:1 (both on cuda:0 with one GPU), KV pools
               in VRAM, so NIXL moves the KV VRAM→VRAM; router in front
  parity       greedy and seeded requests through the router, one at a time, equal token for
               token to single-process generation (services/engine/local_generate.py) on
               cuda:0 in the same dtype
  kv share     one 512- and one 4,096-token prompt: prefill's kv_transfer_latency_seconds
               against the client's TTFT
  serve        a short bench/serve.py run (chat workload, 40 requests at 8 req/s)

Without a CUDA GPU it says so and exits 0. Exit 1 when a check fails, 2 when packages are missing.

Usage: python scripts/gpu_check.py [--out bench/out/gpu_check.json] [--install [--wheelhouse DIR]]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent
CPU_DRY_RUN = False  # --cpu-dry-run: every check on the CPU (tests this script's code paths, not a GPU)
sys.path.insert(0, str(ROOT))

# module -> the requirement that provides it (its pinned version comes from requirements*.txt)
MODULES = {
    "numpy": "numpy", "grpc": "grpcio", "grpc_tools": "grpcio-tools", "grpc_health": "grpcio-health-checking",
    "google.protobuf": "protobuf", "httpx": "httpx", "prometheus_client": "prometheus-client",
    "structlog": "structlog", "fastapi": "fastapi", "uvicorn": "uvicorn", "safetensors": "safetensors",
    "tokenizers": "tokenizers", "jinja2": "jinja2", "yaml": "pyyaml", "transformers": "transformers",
    "llguidance": "llguidance",
}


def gpu_present() -> bool:
    return bool(shutil.which("nvidia-smi")) or os.path.exists("/dev/nvidia0") or os.path.exists("/proc/driver/nvidia")


def pins() -> dict[str, str]:
    out = {}
    for name in ("requirements.txt", "requirements-dev.txt"):
        for line in (ROOT / name).read_text().splitlines():
            m = re.match(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", line.strip())
            if m:
                out[m.group(1).lower()] = m.group(2)
    return out


def missing_requirements(cuda_major: str) -> list[str]:
    missing = []
    for module, req in MODULES.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(req)
    nixl = f"nixl_cu{cuda_major}" if cuda_major in ("12", "13") else "nixl_cu12"
    if importlib.util.find_spec(nixl) is None and importlib.util.find_spec("nixl_cu12") is None:
        missing.append(nixl.replace("_", "-"))
    return missing


def pip_command(reqs: list[str], wheelhouse: str) -> list[str]:
    versions = pins()
    specs = []
    for r in reqs:
        v = versions.get(r) or (versions.get("nixl-cu12") if r.startswith("nixl-") else None)
        specs.append(f"{r}=={v}" if v else r)
    cmd = [sys.executable, "-m", "pip", "install"]
    if wheelhouse:
        cmd += ["--no-index", "--find-links", wheelhouse]
    return cmd + specs


def step(results: dict, name: str, fn) -> None:
    t0 = time.monotonic()
    print(f"[gpu-check] {name} ...", file=sys.stderr, flush=True)
    try:
        out = fn()
        results[name] = {"ok": bool(out.get("ok", True)), **out}
    except Exception as e:  # noqa: BLE001 - recorded; the next checks still run
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    results[name]["seconds"] = round(time.monotonic() - t0, 2)
    print(f"[gpu-check] {name}: {'ok' if results[name]['ok'] else 'FAILED'} in {results[name]['seconds']} s",
          file=sys.stderr, flush=True)


# --- logits against transformers ------------------------------------------------------------------

PROMPT = [5, 17, 42, 99, 3, 250, 7, 7, 64, 128, 11, 200, 31, 8, 77, 150, 2, 9, 61, 33, 45]


def check_logits() -> dict:
    import torch
    import transformers

    from services.engine.kv_pool import KVPool
    from services.engine.loader import load_model
    from services.engine.runner import DecodeItem, ModelRunner, PrefillItem
    from services.fakes.hf_checkpoints import save_tiny_llama, save_tiny_qwen2

    out: dict = {"tolerance": "max|Δ| <= 0.05 + 0.02*max|ref| (bf16 vs transformers bf16, cuda:0)", "models": {}}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name, save, cls in (("llama", save_tiny_llama, transformers.LlamaForCausalLM),
                                ("qwen2", save_tiny_qwen2, transformers.Qwen2ForCausalLM)):
            folder = pathlib.Path(tmp) / name
            folder.mkdir()
            save(folder)
            dev = "cpu" if CPU_DRY_RUN else "cuda:0"
            ids = torch.tensor([PROMPT], device=dev)
            refs = {}
            for dtype in (torch.bfloat16, torch.float32):
                hf = cls.from_pretrained(folder, dtype=dtype).to(dev).eval()
                with torch.no_grad():
                    refs[dtype] = hf(ids).logits[0].float()
                del hf
            ours = load_model(str(folder), device=dev, dtype=torch.bfloat16)
            pool = KVPool(ours.config, num_pages=16, page_size=4, device=ours.device, dtype=torch.bfloat16)
            runner = ModelRunner(ours.model, pool)
            pages = pool.allocator.alloc(pool.pages_for_tokens(len(PROMPT) + 1), owner="check")
            got = []
            cuts = [0, 5, 12, len(PROMPT) - 1]
            for a, b in zip(cuts, cuts[1:], strict=False):
                got.append((b - 1, runner.prefill([PrefillItem(PROMPT[a:b], a, pages)])[0]))
            got.append((len(PROMPT) - 1, runner.decode([DecodeItem(PROMPT[-1], len(PROMPT) - 1, pages)])[0]))
            d_bf16 = max(float((g - refs[torch.bfloat16][p]).abs().max()) for p, g in got)
            d_fp32 = max(float((g - refs[torch.float32][p]).abs().max()) for p, g in got)
            scale = float(refs[torch.bfloat16].abs().max())
            argmax = sum(int(g.argmax()) == int(refs[torch.bfloat16][p].argmax()) for p, g in got)
            model_ok = d_bf16 <= 0.05 + 0.02 * scale
            ok &= model_ok
            out["models"][name] = {"ok": model_ok, "max_abs_diff_vs_hf_bf16": round(d_bf16, 5),
                                   "max_abs_diff_vs_hf_fp32": round(d_fp32, 5), "max_abs_ref": round(scale, 4),
                                   "argmax_equal": f"{argmax}/{len(got)}"}
    return {"ok": ok, **out}


# --- the mesh on GPUs -------------------------------------------------------------------------------


class GpuMesh:
    def __init__(self, tmp: pathlib.Path):
        import torch

        from services.launch.launcher import Launcher

        n = torch.cuda.device_count()
        self.devices = ("cpu", "cpu") if CPU_DRY_RUN else ("cuda:0", "cuda:1") if n >= 2 else ("cuda:0", "cuda:0")
        self.mesh = Launcher(log_dir=tmp)
        env = {"PDMESH_LOG_LEVEL": "warning"}
        self.prefill = self.mesh.start_worker("prefill", "--device", self.devices[0], "--num-pages", "2048",
                                              env=env, wait=False)
        self.decode = self.mesh.start_worker("decode", "--device", self.devices[1], "--num-pages", "2048",
                                             env=env, wait=False)
        for w in (self.prefill, self.decode):
            self.mesh.wait_healthy(w, timeout=180)
        self.router = self.mesh.start_router([self.prefill], [self.decode], "--log-level", "warning")

    def close(self) -> None:
        self.mesh.close()


def check_mesh(gm: GpuMesh) -> dict:
    ph, dh = gm.prefill.health(), gm.decode.health()
    log = gm.prefill.log() + gm.decode.log()
    return {"prefill_device": gm.devices[0], "decode_device": gm.devices[1],
            "same_gpu": gm.devices[0] == gm.devices[1], "prefill_health": ph, "decode_health": dh,
            "vram_in_logs": "VRAM" in log or "vram" in log.lower()}


def check_parity(gm: GpuMesh) -> dict:
    import httpx
    import torch

    from services.common.sampling_params import SamplingParams
    from services.common.tokenizer import load_tokenizer
    from services.engine.kv_pool import KVPool
    from services.engine.loader import load_model
    from services.engine.local_generate import generate_full

    model = load_model(None, device=gm.devices[0])  # the built-in model, the workers' default dtype there
    tokenizer = load_tokenizer(None)  # the router's (the workers' and the router's default --model)
    cases = []
    rng = __import__("random").Random(3)
    for i, n in enumerate((5, 40, 300, 700)):
        ids = [rng.randrange(32, 127) for _ in range(n)]
        sp = (SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i, max_tokens=64, ignore_eos=True))
        cases.append((ids, sp))
    mismatches = []
    for ids, sp in cases:
        body = {"model": "pdmesh-tiny", "prompt": ids, "max_tokens": sp.max_tokens, "ignore_eos": True,
                "temperature": sp.temperature, "top_p": sp.top_p}
        if sp.seed is not None:
            body["seed"] = sp.seed
        r = httpx.post(gm.router.http_url + "/v1/completions", json=body, timeout=120)
        r.raise_for_status()
        text = r.json()["choices"][0]["text"]
        pool = KVPool(model.config, num_pages=256, page_size=16, device=model.device, dtype=model.dtype)
        ref = generate_full(model.model, pool, [ids], [sp])[0].token_ids
        ref_text = tokenizer.decode(ref)
        if text != ref_text:
            first = next((k for k, (a, b) in enumerate(zip(text, ref_text, strict=False)) if a != b),
                         min(len(text), len(ref_text)))
            mismatches.append({"prompt_tokens": len(ids), "seed": sp.seed, "first_difference_at_char": first})
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"ok": not mismatches, "requests": len(cases), "dtype": str(model.dtype), "mismatches": mismatches,
            "compared": "router text vs single-process tokens decoded by the router's tokenizer"}


def check_kv_share(gm: GpuMesh) -> dict:
    from bench import serve

    def sums():
        m = gm.prefill.metrics()
        return (m.get("pdmesh:kv_transfer_latency_seconds_sum", 0.0), m.get("pdmesh:kv_transfer_latency_seconds_count", 0.0),
                m.get("pdmesh:kv_transfer_bytes_sum", 0.0))

    rows = []
    for n in (512, 4096):
        s0, c0, b0 = sums()
        args = serve.parser().parse_args(["--base-url", gm.router.http_url, "--workload", "fixed", "--input-len", str(n),
                                          "--output-len", "4", "--num-requests", "1", "--no-progress"])
        summary, _ = asyncio.run(serve.run(args))
        s1, c1, b1 = sums()
        kv_ms = (s1 - s0) / (c1 - c0) * 1e3 if c1 > c0 else None
        ttft = summary["ttft_ms"]["p50"]
        rows.append({"prompt_tokens": n, "ttft_ms": ttft, "kv_transfer_ms": kv_ms, "kv_bytes": b1 - b0,
                     "kv_share_of_ttft": round(kv_ms / ttft, 4) if kv_ms and ttft else None})
    return {"ok": all(r["kv_transfer_ms"] is not None for r in rows), "rows": rows}


def check_serve(gm: GpuMesh) -> dict:
    from bench import serve

    args = serve.parser().parse_args(["--base-url", gm.router.http_url, "--workload", "chat", "--num-requests", "40",
                                      "--rate", "8", "--no-progress"])
    summary, _ = asyncio.run(serve.run(args))
    return {"ok": summary["errors"] == 0, **summary}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench/out/gpu_check.json"))
    ap.add_argument("--install", action="store_true", help="pip install what is missing, then check")
    ap.add_argument("--wheelhouse", default="", help="with --install: install offline from this folder of wheels")
    ap.add_argument("--cpu-dry-run", action="store_true", help="run every check on the CPU (tests the script itself)")
    args = ap.parse_args(argv)
    global CPU_DRY_RUN
    CPU_DRY_RUN = args.cpu_dry_run
    results: dict = {"machine": {"python": platform.python_version(), "host": platform.node()}}

    if not gpu_present() and not CPU_DRY_RUN:
        print(json.dumps({"gpu": False, "message": "no NVIDIA GPU on this machine (no nvidia-smi, /dev/nvidia0 or "
                          "/proc/driver/nvidia): nothing to check"}))
        return 0
    try:
        import torch
    except ImportError:
        print("[gpu-check] a GPU is present but this Python has no torch: install a CUDA build of torch "
              "(https://pytorch.org/get-started/locally/), then run again", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() and not CPU_DRY_RUN:
        print(json.dumps({"gpu": False, "torch": torch.__version__,
                          "message": f"an NVIDIA device is present but torch {torch.__version__} sees no CUDA GPU "
                                     "(a CPU build, or a driver problem): nothing to check; run with a CUDA torch, "
                                     "e.g. GPU_PYTHON=/usr/bin/python3 make gpu-check"}))
        return 0
    cuda_major = (torch.version.cuda or "").split(".")[0]
    missing = missing_requirements(cuda_major)
    if missing:
        cmd = pip_command(missing, args.wheelhouse)
        if not args.install:
            print("[gpu-check] missing packages: " + ", ".join(missing) + "\ninstall them with:\n  " + " ".join(cmd)
                  + "\n(or run again with --install [--wheelhouse DIR]; never reinstall torch)", file=sys.stderr)
            return 2
        subprocess.run(cmd, check=True)
        importlib.invalidate_caches()
    if not (ROOT / "services/common/generated/pdmesh").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts/gen_proto.py")], check=True, cwd=ROOT)

    results["machine"].update({
        "torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(),
        "gpu_names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    })
    t0 = time.monotonic()
    step(results, "logits", check_logits)
    with tempfile.TemporaryDirectory(prefix="pdmesh-gpu-") as tmp:
        gm = None
        try:
            gm = GpuMesh(pathlib.Path(tmp))
            step(results, "mesh", lambda: check_mesh(gm))
            step(results, "parity", lambda: check_parity(gm))
            step(results, "kv_share", lambda: check_kv_share(gm))
            step(results, "serve", lambda: check_serve(gm))
        except Exception as e:  # noqa: BLE001 - the mesh did not start: recorded
            results["mesh"] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            if gm is None:
                logs = sorted(pathlib.Path(tmp).glob("*.log"))
                results["mesh"]["logs"] = {p.name: p.read_text(errors="replace")[-3000:] for p in logs}
        finally:
            if gm is not None:
                gm.close()
    results["seconds"] = round(time.monotonic() - t0, 1)
    results["ok"] = all(v.get("ok") for k, v in results.items() if isinstance(v, dict) and "ok" in v)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    print(json.dumps(results, indent=2, default=str))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
